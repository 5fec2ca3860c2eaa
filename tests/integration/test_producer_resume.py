"""Crash safety of the producer process: SIGKILL mid-run, re-run, same cache as without a crash."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from producer_helpers import assert_same_samples, cache_samples, chat_rows, write_jsonl

SCRIPT = Path(__file__).with_name("forward_producer.py")


def producer_yaml(tmp_path: Path, model: Path, data: Path, output: str) -> Path:
    config = {"data": str(data), "output": output, "backend": "hf", "layer_ids": [0, 1, 2],
              "hidden_dtype": "bfloat16", "rows_per_unit": 2, "shard_rows": 256,
              "progress": False, "engine": {"model": str(model), "max_model_len": 128}}
    path = tmp_path / f"{Path(output).name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def commits(cache: Path) -> list[Path]:
    return list((cache / "_commits").glob("unit_*.json")) if (cache / "_commits").exists() else []


def start(config: Path, delay_s: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-P", str(SCRIPT), str(delay_s), "produce",
                             "--config", str(config)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_sigkill_then_rerun_gives_the_uninterrupted_cache(tiny_target: Path,
                                                          tmp_path: Path) -> None:
    """A producer killed with SIGKILL after its first commit, then re-run, equals a clean run."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(12))
    clean = producer_yaml(tmp_path, tiny_target, data, str(tmp_path / "clean"))
    assert start(clean, 0.0).wait(timeout=300) == 0

    crashed_out = tmp_path / "crashed"
    crashed = producer_yaml(tmp_path, tiny_target, data, str(crashed_out))
    proc = start(crashed, 0.3)
    deadline = time.monotonic() + 300
    while not commits(crashed_out):
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.35)  # let it get into the middle of the next unit
    assert proc.poll() is None, "the producer finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 1 <= len(commits(crashed_out)) < 6
    assert not (crashed_out / "manifest.json").exists()

    rerun = start(crashed, 0.0)
    output = rerun.communicate(timeout=300)[0].decode()
    assert rerun.returncode == 0, output
    assert_same_samples(cache_samples(str(tmp_path / "clean")), cache_samples(str(crashed_out)))


@pytest.mark.slow
def test_s3_cache_equals_local_cache(tiny_target: Path, moto_server: dict, tmp_path: Path) -> None:
    """Data from and cache into s3:// (moto server) give the same samples as a local run."""
    from producer_helpers import ForwardSource, producer_config

    from sparkforge.producer.run import run

    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(6))
    source = ForwardSource(tiny_target, layer_ids=(1, 2, 3))
    local = producer_config(tiny_target, data, str(tmp_path / "local"))
    run(local, source=source)
    options = moto_server["storage_options"]
    import fsspec

    uri = f"s3://{moto_server['bucket']}/caches/tiny"
    remote_data = f"s3://{moto_server['bucket']}/data/d.jsonl"
    fsspec.filesystem("s3", **options).put(str(data), remote_data)
    remote = producer_config(tiny_target, remote_data, uri, storage_options=options)
    assert run(remote, source=source).finalized
    assert run(remote, source=source).units_done == 0  # re-run: everything committed
    assert_same_samples(cache_samples(local.output), cache_samples(uri, options))
