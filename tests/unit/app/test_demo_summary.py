"""The demo's summary shows tau and acceptance by position, measured and teacher-forced."""

from __future__ import annotations

from pathlib import Path

from sparkforge.app.demo import producer_config, summary_lines, train_config


def test_summary_lists_every_position_of_both_views() -> None:
    """Both tau values and one acceptance per draft position appear, rounded to 2 places."""
    report = {"speculative": {"tau": 2.5, "acceptance_by_position": [0.91, 0.5, 0.125]},
              "teacher_forced": {"metrics": {"tau": 2.25},
                                 "accept_rate_by_position": [0.8, 0.6, 0.4]}}
    lines = summary_lines(report).splitlines()
    assert "2.500" in lines[0]
    assert "2.250" in lines[2]
    assert lines[1].split(":")[1].split() == ["0.91", "0.50", "0.12"]
    assert lines[3].split(":")[1].split() == ["0.80", "0.60", "0.40"]


def test_demo_runs_the_code_target_examples_by_default(tmp_path: Path) -> None:
    """By default the demo's configs are the code target's examples; --target tiny the tiny's."""
    out = tmp_path
    assert train_config(out, steps=5)["model"]["draft"]["vocab_size"] == 2048
    assert train_config(out, steps=5, target="tiny")["model"]["draft"]["vocab_size"] == 1024
    assert producer_config(out)["layer_ids"] == [0, 1, 2]
    assert producer_config(out)["engine"]["model"] == str(out / "target")
