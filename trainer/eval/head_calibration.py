"""What serving reads from the confidence head: STS fitted on half the eval split, measured on
the other half and on the accept events of speculative decoding, beside the head-free ``max q``.

The eval split's teacher-forced blocks are split by batch (so by sample): even batches fit the
temperatures, odd ones test them. ``max q`` (the draft's top probability at T=1, the estimator
engines fall back to without a head) gets the same fit, so the two are compared before and after
calibration. Speculative decoding gives real 0/1 events: the prefix survival of every verified
slot (what an engine schedules on) and the conditional accept event of every trial (the slots
reached with all earlier ones accepted, as ``speculative.calibration`` counts them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparkforge.trainer.eval.calibration import auroc, expected_calibration_error
from sparkforge.trainer.eval.decode_result import SpecDecodeResult
from sparkforge.trainer.eval.sts import calibration_file, fit_sts, logit, survival_metrics


@dataclass(frozen=True)
class SlotRows:
    """Blocks by slot: each estimator's logit, what survived, which slots were verified."""

    head_NK: np.ndarray
    max_q_NK: np.ndarray
    survived_NK: np.ndarray
    valid_NK: np.ndarray

    def logits(self, estimator: str) -> np.ndarray:
        """The head's logits, or the logit of ``max q``."""
        return self.head_NK if estimator == "head" else logit(self.max_q_NK)

    @staticmethod
    def concat(parts: Sequence[SlotRows]) -> SlotRows:
        """One set of rows from several."""
        return SlotRows(*(np.concatenate([getattr(p, name) for p in parts]) for name in (
            "head_NK", "max_q_NK", "survived_NK", "valid_NK")))


def forced_rows(accept_NK: np.ndarray, head_NK: np.ndarray, max_q_NK: np.ndarray,
                valid_NK: np.ndarray) -> SlotRows:
    """Teacher-forced blocks: the expected survival is the product of the acceptances."""
    valid = np.asarray(valid_NK, dtype=bool)
    return SlotRows(head_NK, max_q_NK, np.cumprod(np.where(valid, accept_NK, 0.0), axis=1), valid)


def speculative_rows(runs: Sequence[SpecDecodeResult], k: int) -> SlotRows:
    """Every round's verified slots: slot ``j`` survived when the round accepted more than
    ``j`` draft tokens."""
    rounds = [(logits, max_q, tokens - 1) for r in runs for logits, max_q, tokens in zip(
        r.round_confidence_logits, r.round_max_q, r.tokens_per_round, strict=True)]
    head, max_q = np.zeros((len(rounds), k)), np.full((len(rounds), k), 0.5)
    valid, survived = np.zeros((len(rounds), k), dtype=bool), np.zeros((len(rounds), k))
    for i, (logits, q, accepted) in enumerate(rounds):
        head[i, :len(logits)], max_q[i, :len(q)] = logits, q
        valid[i, :len(logits)] = True
        survived[i, :accepted] = 1.0
    return SlotRows(head, max_q, survived, valid)


def _trial_metrics(rows: SlotRows, estimator: str, temperatures: Sequence[float]
                   ) -> dict[str, Any]:
    """Conditional accept events: slots verified with every earlier slot accepted."""
    prev = np.concatenate([np.ones((rows.valid_NK.shape[0], 1)), rows.survived_NK[:, :-1]], 1)
    trial = rows.valid_NK & (prev > 0.5)
    conf = 1.0 / (1.0 + np.exp(-rows.logits(estimator) / np.asarray(temperatures)[None, :]))
    return {"trials": int(trial.sum()),
            "ece": expected_calibration_error(conf[trial], rows.survived_NK[trial]),
            "auroc": auroc(conf[trial], rows.survived_NK[trial] > 0.5)}


def calibration_study(fit: SlotRows, test: SlotRows, spec: SlotRows | None) -> dict[str, Any]:
    """Fit STS of the head and of ``max q`` on ``fit``: the report section, with each estimator
    before and after on ``test`` and on the speculative events."""
    k = fit.valid_NK.shape[1]
    temperatures = {e: fit_sts(fit.logits(e), fit.survived_NK, fit.valid_NK)
                    for e in ("head", "max_q")}
    rows: dict[str, Any] = {}
    for estimator, temps in temperatures.items():
        for label, used in ((estimator, [1.0] * k), (f"{estimator} + STS", temps)):
            row = {"teacher_forced": survival_metrics(test.logits(estimator), test.survived_NK,
                                                      test.valid_NK, used, events=False)}
            if spec is not None and spec.valid_NK.any():
                row["speculative"] = survival_metrics(spec.logits(estimator), spec.survived_NK,
                                                      spec.valid_NK, used, events=True)
                row["speculative_trials"] = _trial_metrics(spec, estimator, used)
            rows[label] = row
    return {"fit_blocks": int(fit.valid_NK.any(1).sum()),
            "test_blocks": int(test.valid_NK.any(1).sum()),
            "temperatures": temperatures, "estimators": rows}


def calibration_contents(section: Mapping[str, Any]) -> dict[str, Any]:
    """The calibration file of a ``confidence_calibration`` report section: the head's
    temperatures, and the fit's size and ECE before and after as metadata."""
    rows = section["estimators"]
    return calibration_file(section["temperatures"]["head"],
                            source="sparkforge eval (STS on the teacher-forced eval split)",
                            fit_blocks=section["fit_blocks"],
                            ece_before=rows["head"]["teacher_forced"]["ece"],
                            ece_after=rows["head + STS"]["teacher_forced"]["ece"])
