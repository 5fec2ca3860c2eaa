"""The README's `make demo` stays true: the whole pipeline runs through the public CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_runs_every_stage_and_reports_acceptance(tmp_path: Path) -> None:
    """`sparkforge demo` runs every stage on the code target and prints both taus with their
    intervals, acceptance by position and whether the two agree."""
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-P", "-m", "sparkforge.app.cli", "demo", "--out_dir", str(out),
         "--rows", "24", "--train_steps", "10"],
        capture_output=True, text=True, check=False, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    manifest = json.loads((out / "cache" / "manifest.json").read_text())
    assert manifest["complete"] is True
    accounting = manifest["accounting"]
    # Regenerated replies are sampled from the target, which may end its turn at once: such a
    # row is skipped as empty_assistant, never written, and the accounting still balances.
    assert set(accounting["skipped"]) <= {"empty_assistant"}
    assert accounting["written"] + sum(accounting["skipped"].values()) == 24
    assert accounting["written"] >= 20
    assert (out / "draft" / "config.json").exists()
    assert (out / "draft" / "model.safetensors").exists()
    report = json.loads((out / "eval" / "eval_report.json").read_text())
    assert report["speculative"]["tau"] >= 1.0
    assert (out / "eval" / "acceptance_by_position.png").stat().st_size > 0
    assert json.loads((out / "target" / "config.json").read_text())["vocab_size"] == 2048
    assert "measured tau" in result.stdout
    k = 7   # trainer/examples/code_target.yaml's block size
    assert len(report["speculative"]["acceptance_by_position"]) == k
    summary = result.stdout.split("=== demo summary", 1)[1]
    shown = [line for line in summary.splitlines() if "acceptance by position" in line]
    assert len(shown) == 2
    assert all(len(line.split(":", 1)[1].split()) == k for line in shown)
    # regenerated at the temperature it evaluates at: the two taus are compared, with intervals
    assert report["matched"]["matched"] is True
    assert "agreement" in report["matched"]
    assert summary.count("95% CI") == 4   # measured, teacher-forced, its full blocks, difference


@pytest.mark.slow
# One VL target: the MiniMax-M3 VL one runs the same demo stages (its capture and parity on image
# rows: test_vl_pipeline.py); a second demo run would add about 3 minutes to CI.
@pytest.mark.parametrize(("target", "processor"), [("tiny-vl", "Gemma4ImageProcessorPil")])
def test_demo_on_the_tiny_vl_target_decodes_image_prompts(tmp_path: Path, target: str,
                                                          processor: str) -> None:
    """`sparkforge demo --target tiny-vl` (Gemma4) or `tiny-vl-minimax` (MiniMax-M3 VL) captures
    image rows with the HF backend, trains on the mixed cache and reports image and text prompts
    apart."""
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-P", "-m", "sparkforge.app.cli", "demo", "--target", target,
         "--out_dir", str(out), "--rows", "16", "--train_steps", "5"],
        capture_output=True, text=True, check=False, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    manifest = json.loads((out / "cache" / "manifest.json").read_text())
    assert manifest["accounting"]["written"] == 16
    assert manifest["accounting"]["image_rows"] == 8
    assert manifest["producer_config"]["resolved"]["images"]["processor"] == processor
    assert manifest["parity"]["num_image_samples"] == 2
    kinds = json.loads((out / "eval" / "eval_report.json").read_text())["speculative"][
        "by_prompt_kind"]
    # the demo decodes up to 32 prompts: all 16 rows, half of them with an image
    assert kinds["image"]["prompts"] == kinds["text"]["prompts"] == 8
    assert "on image prompts:" in result.stdout
    assert not (out / "regenerated").exists()
