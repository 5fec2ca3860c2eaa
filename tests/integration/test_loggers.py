"""``sparkforge train`` with the TensorBoard and the offline W&B logger: the DSpark metrics and
the run's config and cache provenance are read back from the files each logger wrote."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "trainer" / "examples"
# Per-position acceptance, tau, calibration, anchors kept, data wait: what the CSV log holds.
DSPARK_METRICS = ("train/tau", "train/accept_rate@0", "train/accept_rate@2",
                  "train/confidence_abs_error", "train/confidence_bias",
                  "train/kept_anchor_ratio", "train/data_wait_frac", "train/loss", "val/tau")
STEPS = 6


def _train(cache: str, out: Path, logger_yaml: str) -> None:
    """``sparkforge train`` in its own interpreter, as users run it: the logger's files are
    complete once the process has exited, and no earlier test's state reaches the logger."""
    args = ["train", "--config", str(EXAMPLES / "tiny.yaml"),
            "--config", str(EXAMPLES / logger_yaml), "--data.uri", cache,
            "--trainer.logger.init_args.save_dir", str(out),
            "--trainer.max_steps", str(STEPS), "--trainer.log_every_n_steps", "1",
            "--model.scheduler.total_steps", "60"]
    done = subprocess.run([sys.executable, "-P", "-m", "sparkforge.app.cli", *args], cwd=out,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def _manifest_sha256(cache: str) -> str:
    return hashlib.sha256((Path(cache) / "manifest.json").read_bytes()).hexdigest()


@pytest.mark.slow
def test_tensorboard_event_file_holds_metrics_and_hparams(tiny_cache: str,
                                                          tmp_path: Path) -> None:
    """Every step's DSpark metrics are scalars of the event file; its hparams hold the draft
    config and the cache manifest's sha256."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    _train(tiny_cache, tmp_path, "logger_tensorboard.yaml")
    [run] = list(tmp_path.glob("dspark/version_*"))
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    for name in DSPARK_METRICS:
        assert name in scalars, (name, scalars)
    steps = [e.step for e in events.Scalars("train/tau")]
    assert steps == list(range(1, STEPS + 1))
    assert all(math.isfinite(e.value) and e.value >= 1.0 for e in events.Scalars("train/tau"))
    assert all(0.0 <= e.value <= 1.0 for e in events.Scalars("train/kept_anchor_ratio"))

    hparams: dict[str, object] = {}
    for content in events.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        for key, value in data.session_start_info.hparams.items():
            hparams[key] = value.string_value or value.number_value
    assert hparams["cache/cache_manifest_sha256"] == _manifest_sha256(tiny_cache)
    assert hparams["draft/block_size"] == 4
    assert hparams["uri"] == tiny_cache  # the data module's config
    assert [k for k in hparams if k.startswith("cache/data/sources")], sorted(hparams)


@pytest.mark.slow
def test_wandb_offline_run_holds_metrics_and_config(tiny_cache: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """WANDB_MODE=offline: no network; the run folder's .wandb records hold each step's
    metrics and the config (draft, data, cache provenance)."""
    pytest.importorskip("wandb")
    import wandb_records

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _train(tiny_cache, tmp_path, "logger_wandb.yaml")
    [record_file] = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    rows = wandb_records.history(record_file)
    logged = {key for row in rows for key in row}
    for name in DSPARK_METRICS:
        assert name in logged, (name, sorted(logged))
    taus = [row["train/tau"] for row in rows if "train/tau" in row]
    assert len(taus) == STEPS
    assert all(math.isfinite(t) and t >= 1.0 for t in taus)
    config = wandb_records.config(record_file)
    assert config["cache"]["cache_manifest_sha256"] == _manifest_sha256(tiny_cache)
    assert config["draft"]["block_size"] == 4
    assert config["uri"] == tiny_cache


def test_storage_credentials_are_not_hyperparameters() -> None:
    """The data module's fsspec options (S3 keys) never reach a logger's hyperparameters."""
    from sparkforge.trainer.datamodule import CacheDataModule

    data = CacheDataModule("s3://b/cache", storage_options={"key": "AKIA", "secret": "s3cr3t"})
    assert "storage_options" not in data.hparams_initial
    assert data.hparams_initial["uri"] == "s3://b/cache"
    assert data.storage_options == {"key": "AKIA", "secret": "s3cr3t"}
