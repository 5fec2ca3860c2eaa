"""GPU trainer runs: bf16-mixed with flex attention, and the FSDP strategy (1 GPU)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from sparkforge.app.cli import main

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TINY_YAML = Path(__file__).resolve().parents[2] / "trainer" / "examples" / "tiny.yaml"


def _fit(cache: str, out: Path, *extra: str) -> list[float]:
    code = main(["train", "--config", str(TINY_YAML), "--data.uri", cache,
                 "--trainer.accelerator", "gpu", "--trainer.precision", "bf16-mixed",
                 "--model.attn_implementation", "flex", "--trainer.max_steps", "12",
                 "--trainer.log_every_n_steps", "1",
                 "--trainer.logger.init_args.save_dir", str(out), *extra])
    assert code == 0
    run = sorted(out.glob("dspark/version_*"))[-1]
    with (run / "metrics.csv").open() as f:
        return [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]


def test_bf16_mixed_flex_fit(tiny_cache: str, tmp_path: Path) -> None:
    """bf16-mixed + flex attention trains: finite losses that fall."""
    losses = _fit(tiny_cache, tmp_path)
    assert len(losses) == 12
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) < sum(losses[:3])


def test_fsdp_fit(tiny_cache: str, tmp_path: Path) -> None:
    """FSDP (use_orig_params: frozen embeddings share units) trains and checkpoints."""
    losses = _fit(tiny_cache, tmp_path, "--trainer.strategy", "fsdp")
    assert all(math.isfinite(v) for v in losses)
    assert list(tmp_path.glob("dspark/version_*/checkpoints/last.ckpt"))
