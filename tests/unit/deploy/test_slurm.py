"""The Slurm scripts: their #SBATCH lines, and the command they run parses with sparkforge's own
argument parsers (run through bash with a stand-in ``srun`` that records its argv)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sparkforge.producer.units import resolve_share

ROOT = Path(__file__).resolve().parents[3]
SLURM = ROOT / "docker" / "slurm"


def sbatch_options(script: Path) -> dict[str, str]:
    """``#SBATCH --key=value`` lines up to the first command, as sbatch reads them."""
    options = {}
    for line in script.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            for token in shlex.split(line[len("#SBATCH"):]):
                key, _, value = token.partition("=")
                options[key] = value
        elif line.strip() and not line.startswith("#"):
            break
    return options


def recorded_command(script: Path, tmp_path: Path, env: dict[str, str]) -> list[str]:
    """Run ``script`` with bash; a stand-in ``srun`` on PATH records the command it was given."""
    bin_dir, record = tmp_path / "bin", tmp_path / "srun.json"
    bin_dir.mkdir()
    fake = bin_dir / "srun"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    run_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), **env}
    subprocess.run(["bash", str(script)], env=run_env, check=True, cwd=tmp_path, timeout=60)
    argv: list[str] = json.loads(record.read_text())
    while argv[0].startswith("-"):  # srun's own options
        argv.pop(0)
    return argv


def print_config(argv: list[str]) -> dict[str, object]:
    """Run ``sparkforge <argv> --print_config`` and parse the resolved config it prints."""
    assert argv[0] == "sparkforge"
    out = subprocess.run([sys.executable, "-P", "-m", "sparkforge.app.cli", *argv[1:],
                          "--print_config"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    config: dict[str, object] = yaml.safe_load(out.stdout)
    return config


def test_producer_array_script(tmp_path: Path) -> None:
    """The producer array requeues, takes one GPU per task, and runs `sparkforge produce` whose
    flags parse; each array task k of 0-7 resolves to worker share k of 8."""
    script = SLURM / "produce.sbatch"
    opts = sbatch_options(script)
    assert "--requeue" in opts
    assert opts["--gpus-per-task"] == "1"
    first, last = (int(x) for x in opts["--array"].split("%")[0].split("-"))
    for task in (first, last):
        share = resolve_share(None, None, {"SLURM_ARRAY_TASK_ID": str(task),
                                           "SLURM_ARRAY_TASK_MIN": str(first),
                                           "SLURM_ARRAY_TASK_COUNT": str(last - first + 1),
                                           "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
        assert (share.worker_index, share.num_workers) == (task - first, last - first + 1)
    config = ROOT / "producer" / "examples" / "tiny.yaml"
    argv = recorded_command(script, tmp_path, {"CONFIG": str(config)})
    assert argv[:2] == ["sparkforge", "produce"]
    resolved = print_config(argv)
    assert resolved["output"] == yaml.safe_load(config.read_text())["output"]


@pytest.mark.slow
def test_trainer_script_resumes_from_last_in_a_fixed_folder(tmp_path: Path) -> None:
    """The trainer script requeues, runs one task per GPU, and its `sparkforge train` flags
    resolve to num_nodes x devices with --ckpt_path last in the fixed checkpoint folder."""
    script = SLURM / "train.sbatch"
    opts = sbatch_options(script)
    assert "--requeue" in opts
    assert "--signal" not in opts  # Lightning's SIGUSR1 save goes where "last" never looks
    assert opts["--ntasks-per-node"] == opts["--gpus-per-node"]
    env = {"CONFIG": str(ROOT / "trainer" / "examples" / "tiny.yaml"),
           "CACHE": "s3://bucket/caches/run-1", "CKPT_DIR": "/shared/ckpt/run-1",
           "SLURM_JOB_NUM_NODES": opts["--nodes"],
           "SLURM_NTASKS_PER_NODE": opts["--ntasks-per-node"]}
    argv = recorded_command(script, tmp_path, env)
    assert argv[:2] == ["sparkforge", "train"]
    resolved = print_config(argv)
    trainer, checkpoint = resolved["trainer"], resolved["checkpoint"]
    assert isinstance(trainer, dict)
    assert isinstance(checkpoint, dict)
    assert trainer["num_nodes"] == int(opts["--nodes"])
    assert int(trainer["devices"]) == int(opts["--ntasks-per-node"])  # "8" means 8 GPUs
    assert checkpoint["dirpath"] == "/shared/ckpt/run-1/checkpoints"
    assert resolved["ckpt_path"] == "last"
    assert resolved["data"]["uri"] == "s3://bucket/caches/run-1"  # type: ignore[index]


def test_trainer_script_refuses_to_start_without_a_checkpoint_folder(tmp_path: Path) -> None:
    """Without CKPT_DIR the script stops before srun, so a requeued job never trains from zero
    into a folder it cannot find again."""
    out = subprocess.run(["bash", str(SLURM / "train.sbatch")], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], "CACHE": "s3://b/c"}, cwd=tmp_path)
    assert out.returncode != 0
    assert "CKPT_DIR" in out.stderr
