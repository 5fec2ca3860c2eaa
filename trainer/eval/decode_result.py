"""What one speculative generation yields: its tokens and its acceptance, round by round.

The record every decoder eval measures fills (the reference decoder in
``sparkforge.trainer.eval.speculative``, a serving engine's counts in
``sparkforge.trainer.eval.served_metrics``); torch-free, so the modules that only read it load
no model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeResult:
    """Generated tokens and acceptance statistics of one speculative generation."""

    tokens: list[int]
    """Generated ids (prompt excluded), cut at max_new_tokens / after eos."""
    tokens_per_round: list[int] = field(default_factory=list)
    """Accepted draft tokens + 1 (the token the target sampled) per draft round: tau."""
    verified_per_round: list[int] = field(default_factory=list)
    """Draft tokens sent to verification per round (m <= K)."""
    round_context: list[int] = field(default_factory=list)
    """Per round: the tokens before its anchor (prompt and tokens accepted so far)."""
    position_accepted: list[int] = field(default_factory=list)
    """Per slot k: rounds whose draft token k was accepted."""
    position_trials: list[int] = field(default_factory=list)
    """Per slot k: rounds that verified slot k with every earlier slot accepted."""
    trial_confidence: list[float] = field(default_factory=list)
    """Per verification trial (a slot verified with every earlier slot accepted), in order: the
    confidence head's prediction for it (empty without a head)."""
    trial_accepted: list[bool] = field(default_factory=list)
    """Per verification trial: whether the slot was accepted."""
    round_confidence_logits: list[list[float]] = field(default_factory=list)
    """Per round, the confidence head's logit of each verified slot (empty without a head)."""
    round_max_q: list[list[float]] = field(default_factory=list)
    """Per round, the draft's top probability (at T=1) of each verified slot: the head-free
    acceptance estimator."""
    wall_time_s: float = 0.0

    def count_round(self, *, verified: int, accepted: int) -> None:
        """Record one draft round: ``verified`` slots sent, the first ``accepted`` of them kept.

        Slot ``j`` is a trial when it was verified (``j < verified``) and every earlier slot was
        accepted (``j <= accepted``); the round yields its accepted tokens and the target's one.
        """
        for j in range(min(verified, accepted + 1)):
            self.position_trials[j] += 1
            self.position_accepted[j] += int(j < accepted)
            self.trial_accepted.append(j < accepted)
        self.tokens_per_round.append(accepted + 1)
        self.verified_per_round.append(verified)

    @property
    def tau(self) -> float:
        """Mean tokens per draft round (>= 1); 0 if no round ran."""
        rounds = self.tokens_per_round
        return sum(rounds) / len(rounds) if rounds else 0.0
