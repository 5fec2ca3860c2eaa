"""Reconcile the three taus eval measures: served, reference decoder, teacher-forced.

The served run compared is the one at the draft's own length (the reference decoder always
verifies every draft slot) and the lowest concurrency, on the same prompts and temperature. At
T=0 both decoders are deterministic, so they must agree exactly: the same rounds and accepted
tokens, prompt by prompt. At T>0 they sample independently and must agree within their
intervals. Served and teacher-forced tau are compared only where the existing matched check
compares the reference decoder's (``sparkforge.trainer.eval.matched``): an eval split
regenerated at T=1, measured at T=1, on full blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sparkforge.trainer.eval.bootstrap import agreement
from sparkforge.trainer.eval.decode_result import SpecDecodeResult
from sparkforge.trainer.eval.matched import FORCED_TEMPERATURE


def _counts(runs: Sequence[SpecDecodeResult]) -> tuple[int, int]:
    """Rounds and accepted draft tokens over every prompt."""
    rounds = sum(len(r.tokens_per_round) for r in runs)
    return rounds, sum(sum(r.tokens_per_round) for r in runs) - rounds


def _row(tau: float, ci: Sequence[float] | None, **extra: Any) -> dict[str, Any]:
    return {"tau": tau, "tau_ci95": None if ci is None else list(ci), **extra}


def _interval(side: Mapping[str, Any]) -> list[float]:
    """A side's interval, or its point when it has none (counter totals)."""
    ci = side.get("tau_ci95")
    return list(ci) if ci else [side["tau"], side["tau"]]


def exact_agreement(served: Sequence[SpecDecodeResult],
                    reference: Sequence[SpecDecodeResult]) -> dict[str, Any]:
    """Greedy decoding: equal rounds and accepted tokens, in total and prompt by prompt."""
    (s_rounds, s_acc), (r_rounds, r_acc) = _counts(served), _counts(reference)
    differing = sum(_counts([s]) != _counts([r]) for s, r in zip(served, reference, strict=True))
    same_text = sum(bool(s.tokens) and s.tokens == r.tokens
                    for s, r in zip(served, reference, strict=True))
    return {"exact": True, "agree": (s_rounds, s_acc) == (r_rounds, r_acc) and not differing,
            "rounds": [s_rounds, r_rounds], "accepted_tokens": [s_acc, r_acc],
            "prompts_differing": differing, "outputs_equal": same_text,
            "difference": (s_acc + s_rounds) / s_rounds - (r_acc + r_rounds) / r_rounds
            if s_rounds and r_rounds else 0.0}


def _served_vs_reference(served: Mapping[str, Any], records: Sequence[SpecDecodeResult] | None,
                         reference: Mapping[str, Any], reference_runs: Sequence[SpecDecodeResult],
                         temperature: float) -> dict[str, Any]:
    if not reference:
        return {"note": "the reference decoder did not run (--reference false)"}
    if temperature == 0.0 and records is not None:
        return exact_agreement(records, reference_runs)
    return {"exact": False, **agreement(served["tau"], _interval(served), reference["tau"],
                                        _interval(reference))}


def _served_vs_forced(served: Mapping[str, Any], forced: Mapping[str, Any],
                      matched: Mapping[str, Any] | None, temperature: float) -> dict[str, Any]:
    full = forced.get("full_blocks")
    if matched is None or full is None:
        return {"note": "no cache given: no teacher-forced tau"}
    if not matched.get("matched") or abs(temperature - FORCED_TEMPERATURE) > 1e-6:
        return {"note": matched.get("note", "the eval split does not match eval's sampling")}
    return agreement(served["tau"], _interval(served), full["tau"], full["tau_ci95"])


def reconcile(served: Mapping[str, Any], records: Mapping[tuple[int, int], list[SpecDecodeResult]],
              *, reference: Mapping[str, Any], reference_runs: Sequence[SpecDecodeResult],
              forced: Mapping[str, Any], matched: Mapping[str, Any] | None, k: int,
              temperature: float) -> dict[str, Any]:
    """The ``reconciliation`` section: the three taus side by side and both verdicts."""
    at_k = [r for r in served["runs"] if r["num_speculative_tokens"] == k]
    if not at_k:
        return {"note": f"no served run at the draft's own length k={k} (the reference decoder "
                        "verifies every slot): served runs are not compared"}
    run = min(at_k, key=lambda r: r["concurrency"])
    rows = {"served": _row(run["tau"], run.get("tau_ci95"), rounds=run.get("rounds"),
                           source=run["source"])}
    if reference:
        rows["reference"] = _row(reference["tau"], reference.get("tau_ci95"),
                                 rounds=reference["rounds"])
    if forced.get("full_blocks"):
        full = forced["full_blocks"]
        rows["teacher_forced_full_blocks"] = _row(full["tau"], full["tau_ci95"],
                                                  blocks=full["blocks"])
    return {"temperature": temperature, "num_speculative_tokens": k,
            "concurrency": run["concurrency"], "prompts": served["prompts"], "taus": rows,
            "served_vs_reference": _served_vs_reference(
                run, records.get((k, run["concurrency"])), reference, reference_runs,
                temperature),
            "served_vs_teacher_forced": _served_vs_forced(run, forced, matched, temperature)}
