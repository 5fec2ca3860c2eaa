"""Acceptance of speculative generations: tau with its interval, acceptance by draft position.

One record shape for every decoder that eval measures: the reference decoder
(``sparkforge.trainer.eval.speculative``) and a serving engine
(``sparkforge.trainer.eval.served_metrics`` turns its per-request counts into the same
``SpecDecodeResult``), so the two are compared field by field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sparkforge.trainer.eval.calibration import auroc, brier_score, expected_calibration_error
from sparkforge.trainer.eval.decode_result import SpecDecodeResult
from sparkforge.trainer.eval.report import tau_interval


def calibration_summary(confidence: Any, outcome: Any, *, events: bool) -> dict[str, Any]:
    """ECE, mean absolute error, Brier and (for 0/1 accept events) AUROC of a confidence."""
    conf, out = np.asarray(confidence, dtype=np.float64), np.asarray(outcome, dtype=np.float64)
    report: dict[str, Any] = {"count": int(conf.size),
                              "ece": expected_calibration_error(conf, out),
                              "abs_error": float(np.abs(conf - out).mean()) if conf.size else 0.0,
                              "brier": brier_score(conf, out),
                              "mean_confidence": float(conf.mean()) if conf.size else 0.0,
                              "mean_outcome": float(out.mean()) if out.size else 0.0}
    if events:
        report["auroc"] = auroc(conf, out > 0.5)
    return report


def acceptance_report(runs: Sequence[SpecDecodeResult], k: int, seed: int,
                      temperature: float) -> dict[str, Any]:
    """tau, its 95% interval over prompts (with each prompt's tokens and rounds), acceptance and
    trials by position and calibration (at ``temperature``) over speculative generations."""
    rounds = [n for r in runs for n in r.tokens_per_round]
    verified = [m for r in runs for m in r.verified_per_round]
    accepted = np.sum([r.position_accepted for r in runs], axis=0) if runs else np.zeros(k)
    trials = np.sum([r.position_trials for r in runs], axis=0) if runs else np.zeros(k)
    conf = [c for r in runs for c in r.trial_confidence]
    events = [e for r in runs for e in r.trial_accepted]
    report: dict[str, Any] = {
        "tau": float(np.mean(rounds)) if rounds else 0.0, "rounds": len(rounds),
        "tau_ci95": tau_interval([list(r.tokens_per_round) for r in runs], seed=seed),
        "prompts": len(runs),
        "prompt_tokens": [sum(r.tokens_per_round) for r in runs],
        "prompt_rounds": [len(r.tokens_per_round) for r in runs],
        "verified_per_round": float(np.mean(verified)) if verified else 0.0,
        "acceptance_by_position": [float(a / t) if t else 0.0
                                   for a, t in zip(accepted, trials, strict=True)],
        "position_trials": [float(t) for t in trials],
        "position_accepted": [float(a) for a in accepted]}
    if conf:
        report["calibration"] = {"temperature": temperature,
                                 **calibration_summary(conf, events, events=True)}
    return report
