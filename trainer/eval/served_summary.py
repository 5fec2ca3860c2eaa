"""The plain-text lines of an eval report's served runs and of the reconciliation of its taus."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

VIEWS = {"served": "served", "reference": "reference decoder",
         "teacher_forced_full_blocks": "teacher-forced (full blocks, T=1)"}


def _ci(ci: Sequence[float] | None) -> str:
    return "" if ci is None else f"  95% CI [{ci[0]:.3f}, {ci[1]:.3f}]"


def _run_line(run: Mapping[str, Any]) -> str:
    speedup = f"  speedup {run['speedup']:.2f}x" if "speedup" in run else ""
    return (f"  k={run['num_speculative_tokens']}, {run['concurrency']} in flight: tau "
            f"{run['tau']:.3f}{_ci(run.get('tau_ci95'))} ({run['source'].replace('_', ' ')}), "
            f"{run['tokens_per_s']:.1f} tokens/s{speedup}")


def served_lines(served: Mapping[str, Any], temperature: float) -> list[str]:
    """Each served run (tau, acceptance by position, tokens/s, speedup) and the baseline."""
    where = served["url"] or "vLLM"
    lines = [f"served by {where} ({served['method']} draft, {served['prompts']} prompts at "
             f"T={temperature:g}):"]
    for run in served["runs"]:
        lines.append(_run_line(run))
        if run.get("acceptance_by_position"):
            lines.append("    acceptance by position: "
                         + " ".join(f"{a:.2f}" for a in run["acceptance_by_position"]))
    if served["baseline"]:
        lines.append("  without the draft: " + ", ".join(
            f"{b['concurrency']} in flight {b['tokens_per_s']:.1f} tokens/s"
            for b in served["baseline"]))
    return lines


def _verdict(check: Mapping[str, Any], other: str) -> str:
    if "note" in check:
        return f"not compared: {check['note']}"
    if check.get("exact"):
        (s_rounds, r_rounds), (s_acc, r_acc) = check["rounds"], check["accepted_tokens"]
        if check["agree"]:
            return (f"agree exactly: {s_rounds} rounds and {s_acc} accepted tokens both ways, "
                    f"{check['outputs_equal']} outputs identical")
        return (f"DISAGREE at T=0: served {s_rounds} rounds / {s_acc} accepted, {other} "
                f"{r_rounds} / {r_acc} (tau {check['difference']:+.3f}; "
                f"{check['prompts_differing']} prompts differ)")
    lo, hi = check["difference_ci95"]
    word = "agree" if check["agree"] else "DISAGREE"
    return f"{check['difference']:+.3f}, 95% CI [{lo:+.3f}, {hi:+.3f}]: {word}"


def reconciliation_lines(rec: Mapping[str, Any]) -> list[str]:
    """The three taus side by side, then served against each of the other two."""
    if "taus" not in rec:
        return [f"reconciliation: {rec['note']}"]
    lines = [f"reconciliation (T={rec['temperature']:g}, k={rec['num_speculative_tokens']}, "
             f"{rec['concurrency']} in flight, {rec['prompts']} prompts):"]
    for view, row in rec["taus"].items():
        rounds = f"  {row['rounds']} rounds" if row.get("rounds") is not None else ""
        lines.append(f"  {VIEWS[view]:<43}{row['tau']:.3f}{_ci(row['tau_ci95'])}{rounds}")
    lines.append("  served - reference decoder: "
                 + _verdict(rec["served_vs_reference"], "reference"))
    lines.append("  served - teacher-forced: " + _verdict(rec["served_vs_teacher_forced"],
                                                          "teacher-forced"))
    return lines
