"""The plain-text summary of an eval report: the taus with their intervals, and the verdicts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sparkforge.trainer.eval.served_summary import reconciliation_lines, served_lines


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


def _ci(entry: Mapping[str, Any]) -> str:
    ci = entry.get("tau_ci95")
    return "" if ci is None else f" [{ci[0]:.2f}, {ci[1]:.2f}]"


def _by_context(spec: Mapping[str, Any], forced: Mapping[str, Any]) -> list[str]:
    """One line per context bucket holding data (when two or more do): each tau with its
    interval and its count."""
    measured = {e["bucket"]: e for e in spec.get("by_context", [])}
    taught = {e["bucket"]: e for e in forced.get("by_context", [])}
    lines = []
    for label in dict.fromkeys([*measured, *taught]):
        parts = [f"{name} {e['tau']:.2f}{_ci(e)} ({e['blocks']} {unit})"
                 for name, e, unit in (("measured", measured.get(label), "rounds"),
                                       ("teacher-forced", taught.get(label), "blocks"))
                 if e is not None and e["blocks"]]
        if parts:
            lines.append(_row(f"  context {label}:", ", ".join(parts)))
    # one bucket holding everything repeats the headline taus
    return ["  tau by context (tokens before the anchor):", *lines] if len(lines) > 1 else []


def _by_turn(spec: Mapping[str, Any], forced: Mapping[str, Any]) -> list[str]:
    """One line per view whose turns split: each kind's tau and its count."""
    lines = []
    for view, entry, unit in (("measured", spec.get("by_turn"), "prompts"),
                              ("teacher-forced", forced.get("by_turn"), "samples")):
        if not entry:
            continue
        parts = [f"{kind.replace('_', ' ')} {e['tau']:.2f} ({e[unit]})"
                 for kind, e in entry.items() if e[unit]]
        if len(parts) > 2:  # some turn of another kind than the rest
            lines.append(_row(f"  {view} tau by turn:", ", ".join(parts)))
    return lines


def _full_blocks(forced: Mapping[str, Any]) -> list[str]:
    full = forced.get("full_blocks")
    if not full:
        return []
    total = full["blocks"] + full["cut_blocks"]
    return [_tau(f"  on full blocks ({full['blocks']} of {total}):", full["tau"],
                 full["tau_ci95"])]


def _pair(row: Mapping[str, Any], view: str) -> str:
    """``ECE / AUROC`` of one view of an estimator (``-`` where it has none)."""
    got = row.get(view)
    if not got:
        return "-"
    auc = got.get("auroc")
    return f"{got['ece']:.3f}" + ("" if auc is None else f" / {auc:.3f}")


def _sts(cal: Mapping[str, Any]) -> list[str]:
    """The STS fit: each estimator's ECE (and AUROC) before and after, and the temperatures."""
    lines = [f"  confidence calibration: STS fitted on {cal['fit_blocks']} teacher-forced blocks, "
             f"tested on {cal['test_blocks']} others and on the speculative accept events",
             f"    {'estimator':<14}{'survival ECE':<16}{'survival ECE / AUROC':<24}"
             "trial ECE / AUROC",
             f"    {'':<14}{'(forced)':<16}{'(speculative)':<24}(speculative)"]
    for name, row in cal["estimators"].items():
        lines.append(f"    {name:<14}{_pair(row, 'teacher_forced'):<16}"
                     f"{_pair(row, 'speculative'):<24}{_pair(row, 'speculative_trials')}")
    temps = " ".join(f"{t:.2f}" for t in cal["temperatures"]["head"])
    return [*lines, f"    head temperatures {temps} -> {cal['file']}"]


def _reference(spec: Mapping[str, Any], temperature: float) -> list[str]:
    kinds = spec.get("by_prompt_kind", {})   # image and text prompts apart, when there are images
    return [
        _tau(f"measured tau (T={temperature:g}, {spec['prompts']} prompts):", spec["tau"],
             spec.get("tau_ci95")),
        *(_row(f"  on {kind} prompts:", f"{kinds[kind]['tau']:.3f} ({kinds[kind]['prompts']} "
                                         "prompts)") for kind in sorted(kinds)),
        _row("  acceptance by position:", _values(spec["acceptance_by_position"])),
        _row("  trials by position:", _values(spec["position_trials"], ".0f")),
    ]


def summary_lines(report: Mapping[str, Any]) -> str:
    """Tau (with its 95% interval) and acceptance by draft position, measured and
    teacher-forced, whether the two agree, the confidence head's calibration, tau by context
    length and by kind of turn where those split the data and, when the draft was measured as
    served, each served run and the reconciliation of the three taus."""
    spec, forced = report["speculative"], report["teacher_forced"]
    temperature = report["config"]["temperature"]
    lines = _reference(spec, temperature) if spec else []
    if forced:
        lines += [
            _tau(f"teacher-forced tau (T=1, {forced.get('samples', '?')} eval samples):",
                 forced["metrics"]["tau"], forced.get("tau_ci95")),
            _row("  acceptance by position:", _values(forced["accept_rate_by_position"])),
        ]
        lines += _full_blocks(forced)
        selector = forced.get("selector")
        if selector:   # DFlash2: the top-k candidate head serving drafts through
            lines += [
                _tau("  through the candidate selector, as served:", selector["tau"],
                     selector.get("tau_ci95")),
                _row("    acceptance by position:",
                     _values(selector["accept_rate_by_position"])),
                _row("    data token among the top-k candidates:",
                     f"{selector['candidate_recall']:.3f}"),
                _row("    teacher's mass on them / in its own top-k (ceilings):",
                     f"{selector['candidate_teacher_mass']:.3f} / "
                     f"{selector['teacher_top_k_mass']:.3f}"),
                *("  " + line for line in _full_blocks(selector))]
    if "matched" in report and spec:
        lines.append(_verdict(report["matched"]))
    lines += _calibration(spec, forced) + _by_context(spec, forced) + _by_turn(spec, forced)
    if report.get("confidence_calibration"):
        lines += _sts(report["confidence_calibration"])
    if "served" in report:
        lines += served_lines(report["served"], temperature)
        lines += reconciliation_lines(report["reconciliation"])
    return "\n".join(lines)
