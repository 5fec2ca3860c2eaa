"""sparkforge train/export/eval end to end on a tiny cache written from a real HF forward."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from cache_helpers import cache_spec, forge_rows, slot_object
from export_helpers import foreign_checkpoint, load_in_vllm
from process_helpers import wait_until

from sparkforge.app.cli import main
from sparkforge.shared.layout import row_selection

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = ROOT / "trainer" / "examples" / "tiny.yaml"


def _train_args(cache: str, out: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(TINY_YAML), "--data.uri", cache,
            "--trainer.logger.init_args.save_dir", str(out), "--trainer.log_every_n_steps", "1",
            "--model.scheduler.total_steps", "60", *extra]


def _losses(run_dir: Path) -> dict[int, float]:
    """train/loss by step from the CSV logger (one window per step)."""
    return _metric(run_dir, "train/loss")


def _metric(run_dir: Path, name: str) -> dict[int, float]:
    """One logged column by step."""
    with (run_dir / "metrics.csv").open() as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


def _run_dir(out: Path) -> Path:
    return sorted(out.glob("dspark/version_*"))[-1]


@pytest.fixture(scope="module")
def tiny_run(tiny_cache: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 optimizer steps (5 epochs over the 12 train samples) of the tiny draft."""
    out = tmp_path_factory.mktemp("run")
    assert main(_train_args(tiny_cache, out, "--trainer.max_steps", "30",
                            "--trainer.check_val_every_n_epoch", "5")) == 0
    return _run_dir(out)


@pytest.mark.slow
def test_fit_logs_finite_decreasing_loss_and_checkpoints(tiny_run: Path) -> None:
    """Loss is finite at every step and falls on a repeated small cache; last.ckpt is written."""
    losses = _losses(tiny_run)
    assert sorted(losses) == list(range(1, 31))
    assert all(math.isfinite(v) for v in losses.values())
    first = sum(losses[s] for s in range(1, 6)) / 5
    last = sum(losses[s] for s in range(26, 31)) / 5
    assert last < first - 0.1, (first, last)
    assert (tiny_run / "checkpoints" / "last.ckpt").exists()
    assert (tiny_run / "config.yaml").exists()
    with (tiny_run / "metrics.csv").open() as f:
        header = next(csv.reader(f))
    for name in ("train/tau", "train/accept_rate@0", "train/confidence_abs_error", "train/lr",
                 "train/tokens_per_s", "train/data_wait_frac", "val_loss", "val/tau"):
        assert name in header


def _strings(value: object) -> list[str]:
    """Every string in a checkpoint's nested dicts and lists, keys included."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def test_a_run_names_no_class_its_checkpoint_or_config_reloads_by(tiny_run: Path) -> None:
    """Neither config.yaml nor last.ckpt names a sparkforge class, so a renamed class
    (DSparkLitModule -> DraftLitModule) leaves old runs loadable: the checkpoint loads with
    weights_only (no pickled class) and holds hyper-parameters and the draft config as data."""
    assert "sparkforge." not in (tiny_run / "config.yaml").read_text()
    ckpt = torch.load(tiny_run / "checkpoints" / "last.ckpt", weights_only=True)
    named = [s for s in _strings(ckpt) if "LitModule" in s or "sparkforge." in s]
    assert not named, named
    assert ckpt["hyper_parameters"]["recipe"] == "dspark"
    assert ckpt["draft_config"]["architecture"] == "qwen3"


def test_mismatched_cache_is_refused_before_training(tiny_cache: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose draft does not fit the cache exits 1 naming each field; nothing trains."""
    code = main(_train_args(tiny_cache, tmp_path, "--model.draft.hidden_size", "64",
                            "--model.draft.target_layer_ids", "[0, 1]"))
    err = capsys.readouterr().err
    assert code == 1
    assert "model.hidden_size=64" in err
    assert "model.target_layer_ids=[0, 1]" in err
    assert not list(tmp_path.glob("dspark/version_*/checkpoints/*.ckpt"))


def test_resume_from_last_needs_a_fixed_checkpoint_folder(
        tiny_cache: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--ckpt_path last without --checkpoint.dirpath is refused instead of silently restarting."""
    code = main(_train_args(tiny_cache, tmp_path, "--ckpt_path", "last"))
    assert code == 1
    assert "--checkpoint.dirpath" in capsys.readouterr().err
    assert not list(tmp_path.glob("dspark/version_*/checkpoints/*.ckpt"))


PACKED = ("--data.batching", "pack", "--data.max_seq_len", "96")
"""Packed rows of 96 tokens (the tiny cache's capture length): 3 micro-batches an epoch."""


@pytest.fixture(scope="module")
def bucket_reference(tiny_cache: str, tmp_path_factory: pytest.TempPathFactory
                     ) -> dict[int, float]:
    """The per-step losses of an uninterrupted 9-step run, which a run killed or stopped and
    resumed must reproduce."""
    ref = tmp_path_factory.mktemp("ref")
    assert main(_train_args(tiny_cache, ref, "--trainer.max_steps", "9")) == 0
    return _losses(_run_dir(ref))


@pytest.mark.slow
@pytest.mark.parametrize("data", [(), PACKED], ids=["bucket", "pack"])
def test_killed_run_resumes_with_the_uninterrupted_losses(
        tiny_cache: str, tmp_path: Path, data: tuple[str, ...],
        request: pytest.FixtureRequest) -> None:
    """SIGKILL after the step-4 checkpoint, resume from it: steps 5..9 match an unkilled run."""
    if data:
        ref = tmp_path / "ref"
        assert main(_train_args(tiny_cache, ref, "--trainer.max_steps", "9", *data)) == 0
        want = _losses(_run_dir(ref))
    else:
        want = request.getfixturevalue("bucket_reference")
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-P", "-m", "sparkforge.app.cli",
           *_train_args(tiny_cache, killed, "--trainer.max_steps", "60", *data,
                        "--checkpoint.every_n_train_steps", "4", "--checkpoint.save_top_k", "-1")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        step_8 = "dspark/version_*/checkpoints/*step=8.ckpt"
        wait_until(proc, lambda: bool(list(killed.glob(step_8))), "its step-8 checkpoint")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # Each logged window is flushed as it is logged: the killed run kept its metrics.
    assert set(_losses(_run_dir(killed))) >= set(range(1, 9))
    ckpt = next(killed.glob("dspark/version_*/checkpoints/*step=4.ckpt"))
    resumed = tmp_path / "resumed"
    assert main(_train_args(tiny_cache, resumed, "--trainer.max_steps", "9", *data,
                            "--ckpt_path", str(ckpt))) == 0
    got = _losses(_run_dir(resumed))
    assert sorted(got) == [5, 6, 7, 8, 9]
    if data:
        fill = _metric(_run_dir(resumed), "train/fill_ratio")
        assert all(0.5 < f <= 1.0 for f in fill.values()), fill
        # A packed run's checkpoint exports like any other (rows never reach the draft config).
        assert main(["export", str(ckpt), str(tmp_path / "draft")]) == 0
    assert got == pytest.approx({s: want[s] for s in got}, rel=1e-6, abs=1e-7)


def test_gradient_accumulation_logs_one_window_per_optimizer_step(tiny_cache: str,
                                                                  tmp_path: Path) -> None:
    """With accumulate_grad_batches 4 (6 batches/epoch) each optimizer step logs exactly once."""
    assert main(_train_args(tiny_cache, tmp_path, "--trainer.max_steps", "3",
                            "--trainer.accumulate_grad_batches", "4")) == 0
    with (_run_dir(tmp_path) / "metrics.csv").open() as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert steps == [1, 2, 3]


@pytest.mark.slow
def test_export_loads_in_vllm_and_eval_reports(tiny_run: Path, tiny_target: Path,
                                               tiny_cache: str, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """The trained draft exports, loads through vLLM's DSpark class, and eval reports tau >= 1."""
    ckpt = tiny_run / "checkpoints" / "last.ckpt"
    draft = tmp_path / "draft"
    assert main(["export", str(ckpt), str(draft), "--engine", "vllm"]) == 0
    info = json.loads((draft / "sparkforge_export.json").read_text())
    assert info["cache_uri"] == tiny_cache
    assert info["global_step"] == 30
    assert info["capture_layer_ids"] == [1, 3]
    assert "torch" in info["versions"]
    res = load_in_vllm(tiny_target, draft, timeout=300)
    assert res["method"] == "dspark"
    assert res["draft_architecture"] == ["Qwen3DSparkModel"]
    assert res["aux_layer_ids"] == [1, 3]   # feature ids [0, 2] + 1
    assert res["num_speculative_tokens"] == 4
    assert res["params_without_tensor"] == ["model.mask_embedding"]   # vLLM drops it by design
    assert res["params_not_equal"] == []
    assert res["tensors_not_loaded"] == []
    assert res["confidence_head"] is True

    report_dir = tmp_path / "eval"
    assert main(["eval", "--draft", str(draft), "--target", str(tiny_target), "--cache", tiny_cache,
                 "--out_dir", str(report_dir), "--num_prompts", "3",
                 "--max_new_tokens", "12", "--temperature", "1.0"]) == 0
    report = json.loads((report_dir / "eval_report.json").read_text())
    assert report["speculative"]["tau"] >= 1.0
    assert "lm_head differs" not in caplog.text   # the fp32 target is the draft's own teacher
    assert report["speculative"]["tau"] > 1.0   # at T=1 the trained draft gets tokens accepted
    assert report["speculative"]["rounds"] > 0
    assert len(report["speculative"]["acceptance_by_position"]) == 4
    forced = report["teacher_forced"]
    assert 0.0 <= forced["metrics"]["accept_rate"] <= 1.0
    assert forced["metrics"]["tau"] >= 1.0
    assert "confidence_abs_error" in forced["metrics"]
    assert forced["reliability"]
    png = report_dir / "acceptance_by_position.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _copy(cache: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(cache, tmp_path / "cache"))


def _train_sample(cache: Path) -> dict:
    return next(r for r in pq.read_table(cache / "index.parquet").to_pylist()
                if r["split"] == "train" and r["num_loss_tokens"] >= 2)


def test_nonfinite_hidden_state_stops_training_naming_the_sample(
        tiny_cache: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A NaN the producer committed (crc matches) stops training with the sample id, exit 1;
    every checkpoint saved before it holds finite weights."""
    cache = _copy(tiny_cache, tmp_path)
    sample = _train_sample(cache)
    import zarr
    rows = row_selection(cache_spec(cache), sample["row_offset"], sample["row_offset"] + 1)
    row = np.asarray(zarr.open_group(str(cache), mode="r")["aux_hidden.0"][rows])
    row[0, 5] = 0x7FC0  # bf16 NaN at token 0: every anchor's context sees it
    forge_rows(cache, "aux_hidden.0", sample["row_offset"], row)
    out = tmp_path / "run"
    code = main(_train_args(str(cache), out, "--trainer.max_steps", "30",
                            "--checkpoint.every_n_train_steps", "1",
                            "--checkpoint.save_top_k", "-1"))
    err = capsys.readouterr().err
    assert code == 1
    assert f"samples [{sample['sample_id']}] hold non-finite hidden states" in err
    assert "no checkpoint holds it" in err
    for ckpt in out.glob("dspark/version_*/checkpoints/*.ckpt"):
        state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def _train_process(cache: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-P", "-m", "sparkforge.app.cli",
           *_train_args(str(cache), out, "--trainer.max_steps", "4", *extra)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


def test_corrupt_chunk_in_a_worker_ends_train_with_one_line(tiny_cache: str,
                                                            tmp_path: Path) -> None:
    """A zstd-corrupt chunk read by a DataLoader worker: exit 1, one line naming unit, slot and
    array, no traceback."""
    cache = _copy(tiny_cache, tmp_path)
    sample = _train_sample(cache)
    chunk = slot_object(cache, "input_ids", sample["slot"])
    data = bytearray(chunk.read_bytes())
    data[8:24] = b"\xff" * 16
    chunk.write_bytes(bytes(data))
    proc = _train_process(cache, tmp_path / "run", "--data.num_workers", "2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("sparkforge train: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert f"unit {sample['unit']}, slot {sample['slot']}: array input_ids: cannot be decoded" \
        in lines[0]
    assert "Traceback" not in proc.stderr


def test_index_row_count_mismatch_exits_1_not_abort(tiny_cache: str, tmp_path: Path) -> None:
    """An index missing a row (re-sealed in the manifest) ends with exit 1, twice in a row: the
    abort at interpreter exit was intermittent."""
    import hashlib
    import io

    import pyarrow as pa

    cache = _copy(tiny_cache, tmp_path)
    table = pq.read_table(cache / "index.parquet")
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(table.to_pylist()[1:], schema=table.schema), buf)
    (cache / "index.parquet").write_bytes(buf.getvalue())
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["storage"]["index_sha256"] = hashlib.sha256(buf.getvalue()).hexdigest()
    (cache / "manifest.json").write_text(json.dumps(manifest))
    for attempt in range(2):
        proc = _train_process(cache, tmp_path / f"run{attempt}")
        assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
        assert "15 rows != manifest storage.totals.samples 16" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_unit_dropped_from_manifest_index_and_commits_is_refused(
        tiny_cache: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A consistent cache that lost a whole unit after the run: the run header still counts it,
    so train refuses before the first step instead of training on what is left."""
    from sparkforge.manifests.finalize import finalize_cache

    cache = _copy(tiny_cache, tmp_path)
    commits = sorted((cache / "_commits").glob("*/unit_*.json"))
    commits[-1].unlink()
    (cache / "manifest.json").unlink()
    finalize_cache(str(cache), expected_units=len(commits) - 1)
    out = tmp_path / "run"
    assert main(_train_args(str(cache), out, "--trainer.max_steps", "2")) == 1
    err = capsys.readouterr().err
    assert (f"promises producer_config.resolved.num_units = {len(commits)} units, but the "
            f"manifest has {len(commits) - 1}") in err, err[-2000:]
    assert not list(out.rglob("*.ckpt")), "refused before the first step"


@pytest.mark.parametrize("kind", ["random_bytes", "code_running_pickle"])
def test_a_foreign_ckpt_path_is_refused_in_one_line(tiny_cache: str, tmp_path: Path, kind: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """--ckpt_path on random bytes or a code-running pickle: exit 1, the line export gives, no
    code run, no training."""
    ckpt = foreign_checkpoint(kind, tmp_path / "foreign.ckpt")
    out = tmp_path / "run"
    assert main(_train_args(tiny_cache, out, "--trainer.max_steps", "2",
                            "--ckpt_path", str(ckpt))) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"sparkforge train: error: {ckpt}: not a sparkforge train "
                              "checkpoint"), err[-5:]
    assert not ckpt.with_suffix(".ran").exists()
    assert not list(out.rglob("*.ckpt"))


def test_a_folder_holding_another_runs_checkpoints_is_refused_unless_resumed(
        tiny_cache: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A second run into a fixed --checkpoint.dirpath that holds the first run's checkpoints is
    refused (they used to mix silently); resuming that run with --ckpt_path last is allowed."""
    folder = tmp_path / "ckpt"
    fixed = ("--checkpoint.dirpath", str(folder))
    assert main(_train_args(tiny_cache, tmp_path / "a", "--trainer.max_steps", "2", *fixed)) == 0
    before = sorted(p.name for p in folder.glob("*.ckpt"))
    capsys.readouterr()
    assert main(_train_args(tiny_cache, tmp_path / "b", "--trainer.max_steps", "2", *fixed)) == 1
    assert f"checkpoint folder {folder} holds another run's checkpoints" in capsys.readouterr().err
    assert sorted(p.name for p in folder.glob("*.ckpt")) == before, "nothing of run b written"
    assert main(_train_args(tiny_cache, tmp_path / "c", "--trainer.max_steps", "3", *fixed,
                            "--ckpt_path", "last")) == 0


def test_a_folder_another_live_run_holds_is_refused(
        tiny_cache: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """While a run holds the folder's lock (taken here as that run does), a run started into the
    same folder is refused before writing anything."""
    import fcntl

    from sparkforge.trainer.run_folder.checkpoints import LOCK_NAME

    folder = tmp_path / "ckpt"
    folder.mkdir()
    with (folder / LOCK_NAME).open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert main(_train_args(tiny_cache, tmp_path / "b", "--trainer.max_steps", "2",
                                "--checkpoint.dirpath", str(folder))) == 1
    assert "another sparkforge train run is writing there" in capsys.readouterr().err
    assert not list(folder.glob("*.ckpt"))


def test_enable_checkpointing_false_trains_and_writes_no_checkpoint(
        tiny_cache: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The standard Lightning setting is honoured (it died with MisconfigurationException because
    the trainer always added its checkpoint callback), and the run says it writes none."""
    out = tmp_path / "run"
    assert main(_train_args(tiny_cache, out, "--trainer.max_steps", "2",
                            "--trainer.enable_checkpointing", "false")) == 0
    assert not list(out.rglob("*.ckpt"))
    assert "trainer.enable_checkpointing is false: this run writes no checkpoint" in caplog.text


@pytest.mark.parametrize(("extra", "code", "message"), [
    (("--data.batching", "pack", "--model.draft.num_anchors", "100000"), 2,
     "--model.draft.num_anchors 100000 is more than the 256 positions of a training row"),
    (("--model.draft.num_anchors", "257"), 2, "num_anchors 257 is more than the 256 positions"),
    (("--data.min_loss_tokens", "100000"), 1,
     "has data.min_loss_tokens=100000 supervised tokens: nothing to train on"),
])
def test_a_run_no_row_can_feed_is_refused_before_training(
        tiny_cache: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        extra: tuple[str, ...], code: int, message: str) -> None:
    """Anchors no row can hold (100,000 used to allocate 320 GB) and a filter that leaves no
    sample (used to train 0 steps and exit 0) are one line before anything is allocated."""
    assert main(_train_args(tiny_cache, tmp_path, *extra)) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err[-3:]
    assert not list(tmp_path.glob("dspark/version_*/checkpoints/*.ckpt"))


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_exits_143_and_resumes_exactly(
        tiny_cache: str, tmp_path: Path, bucket_reference: dict[int, float]) -> None:
    """A SIGTERM to the whole process group (as a scheduler sends it; one loader worker) stops
    the run at the next optimizer step with last.ckpt and exit 143 (it used to train on to the
    epoch end and exit 0); --ckpt_path last continues with the uninterrupted run's losses."""
    args = ("--data.num_workers", "1", "--checkpoint.every_n_train_steps", "2")
    ckpts = tmp_path / "ckpt"
    stopped = ("--checkpoint.dirpath", str(ckpts), *args)
    # Every checkpoint kept: with only the latest, step 2's lived two steps, and a fast run
    # replaced it before a poll saw it (CI: the run ended at step 60, never seen at step 2).
    cmd = [sys.executable, "-P", "-m", "sparkforge.app.cli",
           *_train_args(tiny_cache, tmp_path / "run", "--trainer.max_steps", "60", *stopped,
                        "--checkpoint.save_top_k", "-1")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_until(proc, lambda: bool(list(ckpts.glob("*step=2.ckpt"))), "its step-2 checkpoint")
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("sparkforge train: stopped by SIGTERM after step "), last
    step = int(last.split("after step ")[1].split(":")[0])
    assert 2 <= step < 9, last
    assert f"saved the resumable checkpoint {ckpts / 'last.ckpt'}" in last
    assert torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == step
    assert main(_train_args(tiny_cache, tmp_path / "resumed", "--trainer.max_steps", "9",
                            *stopped, "--ckpt_path", "last")) == 0
    got = _losses(_run_dir(tmp_path / "resumed"))
    assert sorted(got) == list(range(step + 1, 10))
    assert got == pytest.approx({s: bucket_reference[s] for s in got}, rel=1e-6, abs=1e-7)
