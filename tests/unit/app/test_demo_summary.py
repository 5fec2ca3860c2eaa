"""The demo's summary: both taus with intervals, acceptance by position, agreement, calibration."""

from __future__ import annotations

from pathlib import Path

from sparkforge.app.demo import producer_config, summary_lines, train_config


def _report(**matched: object) -> dict:
    return {"config": {"temperature": 1.0},
            "speculative": {"tau": 2.5, "tau_ci95": [2.25, 2.75], "prompts": 16,
                            "acceptance_by_position": [0.91, 0.5, 0.125],
                            "position_trials": [40, 36, 18],
                            "calibration": {"temperature": 1.0, "ece": 0.04, "abs_error": 0.3,
                                            "count": 94}},
            "teacher_forced": {"metrics": {"tau": 2.25}, "tau_ci95": [2.0, 2.5], "samples": 9,
                               "accept_rate_by_position": [0.8, 0.6, 0.4],
                               "full_blocks": {"tau": 2.375, "tau_ci95": [2.125, 2.625],
                                               "blocks": 30, "cut_blocks": 6}},
            "matched": matched}


def test_summary_lists_both_taus_with_intervals_and_every_position() -> None:
    """Both tau values with their intervals, one acceptance and trial count per draft position,
    the agreement verdict and the head's calibration appear."""
    agreement = {"difference": 0.25, "difference_ci95": [-0.1, 0.6], "agree": True}
    lines = summary_lines(_report(agreement=agreement)).splitlines()
    assert "2.500  95% CI [2.250, 2.750]" in lines[0]
    assert "T=1, 16 prompts" in lines[0]
    assert lines[1].split(":")[1].split() == ["0.91", "0.50", "0.12"]
    assert lines[2].split(":")[1].split() == ["40", "36", "18"]
    assert "2.250  95% CI [2.000, 2.500]" in lines[3]
    assert lines[4].split(":")[1].split() == ["0.80", "0.60", "0.40"]
    assert "on full blocks (30 of 36):" in lines[5]
    assert "2.375  95% CI [2.125, 2.625]" in lines[5]
    assert "+0.250, 95% CI [-0.100, +0.600]: agree" in lines[6]
    assert "speculative at T=1: ECE 0.040, abs error 0.300 over 94 slots" in lines[7]
    refused = summary_lines(_report(agreement=dict(agreement, agree=False)))
    assert "DISAGREE" in refused


def test_summary_splits_by_context_and_turn_only_where_the_data_does() -> None:
    """Buckets print when two or more hold data (each tau, interval and count); a turn split
    prints when a view has turns of both kinds."""
    report = _report(agreement={"difference": 0.0, "difference_ci95": [-1, 1], "agree": True})
    plain = summary_lines(report)
    report["speculative"]["by_context"] = [
        {"bucket": "<1K", "tau": 2.5, "tau_ci95": [2.0, 3.0], "blocks": 40},
        {"bucket": "1K-4K", "tau": 1.5, "tau_ci95": None, "blocks": 3},
        {"bucket": ">=4K", "tau": 0.0, "tau_ci95": None, "blocks": 0}]
    report["teacher_forced"]["by_turn"] = {
        "thinking": {"tau": 3.0, "samples": 4}, "no_thinking": {"tau": 2.0, "samples": 5},
        "tool_call": {"tau": 0.0, "samples": 0}, "no_tool_call": {"tau": 2.25, "samples": 9}}
    text = summary_lines(report)
    assert text.startswith(plain)
    tail = text[len(plain):].splitlines()[1:]
    assert "tau by context" in tail[0]
    assert "context <1K:" in tail[1]
    assert "measured 2.50 [2.00, 3.00] (40 rounds)" in tail[1]
    assert "measured 1.50 (3 rounds)" in tail[2]
    assert "teacher-forced tau by turn:" in tail[3]
    assert "thinking 3.00 (4), no thinking 2.00 (5), no tool call 2.25 (9)" in tail[3]
    assert len(tail) == 4


def test_summary_says_why_it_does_not_compare() -> None:
    """A mismatched eval split prints the report's note instead of a verdict."""
    text = summary_lines(_report(matched=False, note="regenerated at T=[0.0]"))
    assert "not compared: regenerated at T=[0.0]" in text


def test_demo_runs_the_code_target_examples_by_default(tmp_path: Path) -> None:
    """By default the demo's configs are the code target's examples; --target tiny the tiny's."""
    out = tmp_path
    assert train_config(out, steps=5)["model"]["draft"]["vocab_size"] == 2048
    assert train_config(out, steps=5, target="tiny")["model"]["draft"]["vocab_size"] == 1024
    assert producer_config(out)["layer_ids"] == [0, 1, 2]
    assert producer_config(out)["engine"]["model"] == str(out / "target")
