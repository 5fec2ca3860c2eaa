"""A run without a logger or root folder (``--trainer.logger false``) writes only below
``runs/``, into the one run folder it prints, on every DDP rank; a rerun finds that folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ddp_ranks import start_ranks

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = ROOT / "trainer" / "examples" / "tiny.yaml"
PREFIX = "run folder: "


def _cmd(cache: str, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-P", "-m", "sparkforge.app.cli", "train", "--config",
            str(TINY_YAML), "--data.uri", cache, "--trainer.logger", "false",
            "--trainer.max_steps", str(steps), "--model.scheduler.total_steps", "60", *extra]


def _train(cwd: Path, cache: str, steps: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cmd(cache, steps, *extra), cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def _printed_folder(stderr: str) -> Path:
    [line] = [ln for ln in stderr.splitlines() if ln.startswith(PREFIX)]
    return Path(line.removeprefix(PREFIX))


@pytest.mark.slow
def test_unconfigured_run_writes_only_its_printed_run_folder(tiny_cache: str,
                                                             tmp_path: Path) -> None:
    """Checkpoints and config.yaml land in the printed folder below runs/, nothing else in the
    cwd; the same config again is refused naming its run folder, and --ckpt_path last extends
    that run in place."""
    done = _train(tmp_path, tiny_cache, 2)
    assert done.returncode == 0, done.stderr[-4000:]
    folder = _printed_folder(done.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert folder.parent.parent == tmp_path / "runs"
    assert (folder / "config.yaml").is_file()
    assert (folder / "checkpoints" / "last.ckpt").is_file()
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["run_folder"] == str(folder)
    assert Path(summary["last_checkpoint"]).parent == folder / "checkpoints"

    again = _train(tmp_path, tiny_cache, 2)
    assert again.returncode == 1
    assert f"an earlier run of this same config: {folder} is its run folder" in again.stderr
    longer = _train(tmp_path, tiny_cache, 3, "--ckpt_path", "last")
    assert longer.returncode == 0, longer.stderr[-4000:]
    assert _printed_folder(longer.stderr) == folder
    assert json.loads(longer.stdout[longer.stdout.index("{"):])["global_step"] == 3
    other_seed = _train(tmp_path, tiny_cache, 2, "--seed_everything", "1")
    assert other_seed.returncode == 0, other_seed.stderr[-4000:]
    assert _printed_folder(other_seed.stderr) != folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


@pytest.mark.slow
def test_ddp_ranks_share_one_run_folder(tiny_cache: str, tmp_path: Path) -> None:
    """Two CPU DDP ranks, started as torchrun starts them, print the same run folder and write
    the checkpoint and config.yaml there, nothing outside runs/."""
    procs = start_ranks(_cmd(tiny_cache, 2, "--trainer.devices", "2", "--trainer.strategy", "ddp"),
                        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    folders = {_printed_folder(err) for _, err in outs}
    assert len(folders) == 1, folders
    [folder] = folders
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert [p.name for p in (tmp_path / "runs" / "dspark").iterdir()] == [folder.name]
    assert (folder / "config.yaml").is_file()
    assert (folder / "checkpoints" / "last.ckpt").is_file()
