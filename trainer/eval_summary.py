"""The plain-text summary of an eval report: both taus with their intervals, and the verdict."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _values(values: Sequence[float], spec: str = ".2f") -> str:
    return " ".join(format(v, spec) for v in values)


def _row(label: str, text: str) -> str:
    return f"  {label:<45}{text}"


def _tau(label: str, tau: float, ci: Sequence[float] | None) -> str:
    interval = "" if ci is None else f"  95% CI [{ci[0]:.3f}, {ci[1]:.3f}]"
    return _row(label, f"{tau:.3f}{interval}")


def _verdict(matched: Mapping[str, Any]) -> str:
    agreement = matched.get("agreement")
    if agreement is None:
        return f"  not compared: {matched.get('note', 'no teacher-forced interval')}"
    lo, hi = agreement["difference_ci95"]
    word = "agree" if agreement["agree"] else "DISAGREE"
    return (f"  speculative - teacher-forced (full blocks): {agreement['difference']:+.3f}, 95% CI "
            f"[{lo:+.3f}, {hi:+.3f}]: {word} (eval split regenerated at the eval temperature)")


def _calibration(spec: Mapping[str, Any], forced: Mapping[str, Any]) -> list[str]:
    lines = []
    for view, cal in (("teacher-forced", forced.get("calibration")),
                      ("speculative", spec.get("calibration"))):
        if cal:
            lines.append(f"  confidence head, {view} at T={cal['temperature']:g}: "
                         f"ECE {cal['ece']:.3f}, abs error {cal['abs_error']:.3f} "
                         f"over {cal['count']} slots")
    return lines


def summary_lines(report: Mapping[str, Any]) -> str:
    """Tau (with its 95% interval) and acceptance by draft position, measured and
    teacher-forced, whether the two agree, and the confidence head's calibration."""
    spec, forced = report["speculative"], report["teacher_forced"]
    temperature = report["config"]["temperature"]
    kinds = spec.get("by_prompt_kind", {})   # image and text prompts apart, when there are images
    lines = [
        _tau(f"measured tau (T={temperature:g}, {spec['prompts']} prompts):", spec["tau"],
             spec.get("tau_ci95")),
        *(_row(f"  on {kind} prompts:", f"{kinds[kind]['tau']:.3f} ({kinds[kind]['prompts']} "
                                         "prompts)") for kind in sorted(kinds)),
        _row("  acceptance by position:", _values(spec["acceptance_by_position"])),
        _row("  trials by position:", _values(spec["position_trials"], ".0f")),
    ]
    if forced:
        lines += [
            _tau(f"teacher-forced tau (T=1, {forced.get('samples', '?')} eval samples):",
                 forced["metrics"]["tau"], forced.get("tau_ci95")),
            _row("  acceptance by position:", _values(forced["accept_rate_by_position"])),
        ]
        full = forced.get("full_blocks")
        if full:
            total = full["blocks"] + full["cut_blocks"]
            lines.append(_tau(f"  on full blocks ({full['blocks']} of {total}):", full["tau"],
                              full["tau_ci95"]))
    if "matched" in report:
        lines.append(_verdict(report["matched"]))
    return "\n".join(lines + _calibration(spec, forced))
