"""The README's `make demo` stays true: the whole pipeline runs through the public CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_runs_every_stage_and_reports_acceptance(tmp_path: Path) -> None:
    """`sparkforge demo` regenerates, captures, validates, trains, exports and evaluates."""
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-P", "-m", "sparkforge.app.cli", "demo", "--out_dir", str(out),
         "--rows", "24", "--train_steps", "10"],
        capture_output=True, text=True, check=False, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    manifest = json.loads((out / "cache" / "manifest.json").read_text())
    assert manifest["complete"] is True
    assert manifest["accounting"]["written"] == 24
    assert (out / "draft" / "config.json").exists()
    assert (out / "draft" / "model.safetensors").exists()
    report = json.loads((out / "eval" / "eval_report.json").read_text())
    assert report["speculative"]["tau"] >= 1.0
    assert (out / "eval" / "acceptance_by_position.png").stat().st_size > 0
    assert "measured tau" in result.stdout
