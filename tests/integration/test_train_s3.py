"""Training streams its cache from S3 (a real moto server on 127.0.0.1) through fsspec."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
from cache_helpers import write_tiny_cache

from sparkforge.app.cli import main

TINY_YAML = Path(__file__).resolve().parents[2] / "trainer" / "examples" / "tiny.yaml"


@pytest.mark.slow
def test_training_streams_from_s3(moto_server: dict[str, Any], tiny_target: Path,
                                  tmp_path: Path) -> None:
    """A cache on S3 trains 4 steps with 2 loader workers; finite losses, a checkpoint."""
    options = moto_server["storage_options"]
    uri = f"s3://{moto_server['bucket']}/trainer/tiny-cache"
    write_tiny_cache(uri, tiny_target, storage_options=options)
    code = main(["train", "--config", str(TINY_YAML), "--data.uri", uri,
                 "--data.storage_options", json.dumps(options), "--data.num_workers", "2",
                 "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "1",
                 "--trainer.logger.init_args.save_dir", str(tmp_path)])
    assert code == 0
    run = sorted(tmp_path.glob("dspark/version_*"))[-1]
    with (run / "metrics.csv").open() as f:
        losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(losses) == 4
    assert all(math.isfinite(v) for v in losses)
    assert (run / "checkpoints" / "last.ckpt").exists()
