"""What a serving engine reports of speculative decoding, read into eval's acceptance records.

vLLM (0.32) answers each completion with ``metrics.speculative_decoding`` when it runs with
``--per-request-spec-decode-metrics``: at ``detailed`` the accepted and drafted count of every
verify step (``per_step_accepted``, ``per_step_drafted``), at ``summary`` their histogram
(``acceptance_histogram[j]``: steps that accepted ``j`` draft tokens). Those become the same
``SpecDecodeResult`` the reference decoder returns, one per prompt, so tau keeps its interval over
prompts. Without them, ``/metrics`` gives totals only: vLLM's counters
``vllm:spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens`` /
``_num_accepted_tokens_per_pos`` (their change over the run), SGLang's running means
``sglang:spec_accept_length`` and ``sglang:spec_accept_rate`` beside its request counter.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparkforge.shared.errors import SparkforgeError
from sparkforge.trainer.eval.decode_result import SpecDecodeResult

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+"
                     r"(?P<value>\S+)")
_POSITION = re.compile(r'position="(\d+)"')
_VLLM = "vllm:spec_decode_"


def request_rounds(spec: Mapping[str, Any], tokens: list[int]) -> SpecDecodeResult:
    """One request's verify steps as a ``SpecDecodeResult`` (``tokens``: what it generated).

    A ``summary`` histogram keeps no order and no per-step draft count: each step is taken to
    have drafted ``num_spec_tokens``, in histogram order.
    """
    k = int(spec["num_spec_tokens"])
    if spec.get("per_step_accepted") is not None:
        steps = list(zip(spec["per_step_accepted"], spec["per_step_drafted"], strict=True))
    else:
        steps = [(j, k) for j, count in enumerate(spec["acceptance_histogram"])
                 for _ in range(int(count))]
    res = SpecDecodeResult(tokens=list(tokens), position_accepted=[0] * k,
                           position_trials=[0] * k)
    for accepted, drafted in steps:
        res.count_round(verified=int(drafted), accepted=int(accepted))
    return res


@dataclass
class SpecCounters:
    """The speculative-decoding totals of one ``/metrics`` page (summed over engines)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_position: dict[int, float] = field(default_factory=dict)
    sglang_accept_length: float | None = None
    """SGLang's running mean of tokens per verify step (a gauge, not a counter)."""
    requests: float = 0.0
    """SGLang's ``sglang:num_requests_total``."""

    def minus(self, before: SpecCounters) -> SpecCounters:
        """The change from ``before`` to these totals (a run's share of them)."""
        positions = self.accepted_per_position.keys() | before.accepted_per_position.keys()
        return SpecCounters(
            drafts=self.drafts - before.drafts,
            draft_tokens=self.draft_tokens - before.draft_tokens,
            accepted=self.accepted - before.accepted,
            accepted_per_position={p: self.accepted_per_position.get(p, 0.0)
                                   - before.accepted_per_position.get(p, 0.0)
                                   for p in sorted(positions)},
            sglang_accept_length=_weighted_change(before, self),
            requests=self.requests - before.requests)


def _weighted_change(before: SpecCounters, after: SpecCounters) -> float | None:
    """The mean of SGLang's accept-length gauge over the requests between two pages."""
    if after.sglang_accept_length is None:
        return None
    new = after.requests - before.requests
    if new <= 0:
        return None
    old = (before.sglang_accept_length or 0.0) * before.requests
    return (after.sglang_accept_length * after.requests - old) / new


def parse_counters(text: str) -> SpecCounters:
    """The speculative-decoding totals of a Prometheus text page (vLLM or SGLang)."""
    out = SpecCounters()
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match["name"].endswith("_created"):
            continue
        name, value = match["name"].removesuffix("_total"), float(match["value"])
        if name == _VLLM + "num_drafts":
            out.drafts += value
        elif name == _VLLM + "num_draft_tokens":
            out.draft_tokens += value
        elif name == _VLLM + "num_accepted_tokens":
            out.accepted += value
        elif name == _VLLM + "num_accepted_tokens_per_pos":
            pos = _POSITION.search(match["labels"] or "")
            if pos is not None:
                p = int(pos[1])
                out.accepted_per_position[p] = out.accepted_per_position.get(p, 0.0) + value
        elif name == "sglang:spec_accept_length":
            out.sglang_accept_length = value
        elif name == "sglang:num_requests":
            out.requests += value
    return out


def counters_acceptance(delta: SpecCounters) -> dict[str, Any]:
    """tau and acceptance by position from a run's counter change (no interval: totals only).

    Position ``j``'s trials are the steps that accepted every earlier slot, which vLLM counts
    as position ``j - 1``'s accepted tokens (every step drafting ``num_speculative_tokens``).
    """
    if delta.drafts > 0:
        per_pos = [delta.accepted_per_position[p] for p in sorted(delta.accepted_per_position)]
        trials = [delta.drafts, *per_pos[:-1]]
        return {"source": "counters", "tau": 1.0 + delta.accepted / delta.drafts,
                "tau_ci95": None, "rounds": int(delta.drafts),
                "accepted_tokens": int(delta.accepted), "draft_tokens": int(delta.draft_tokens),
                "acceptance_by_position": [a / t if t else 0.0
                                           for a, t in zip(per_pos, trials, strict=True)],
                "position_trials": trials, "position_accepted": per_pos}
    if delta.sglang_accept_length is not None:
        return {"source": "counters", "tau": delta.sglang_accept_length, "tau_ci95": None,
                "note": "SGLang's running mean of accept length over the run's requests "
                        "(no rounds, no acceptance by position)"}
    raise SparkforgeError("the server's /metrics shows no speculative decoding during the run "
                          "(no vllm:spec_decode_* change, no sglang:spec_accept_length): is "
                          "it serving with a draft?")
