"""The commit protocol under a real SIGKILL, locally and on moto S3: resume gives exactly once."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cache_helpers import make_run_header, make_unit
from process_helpers import wait_until

from sparkforge.manifests.finalize import finalize_cache
from sparkforge.manifests.open import open_cache
from sparkforge.shared.layout import CacheSpec
from sparkforge.shared.writer import CacheWriter

SPEC = CacheSpec(hidden_size=32, num_aux_layers=2, hidden_dtype="bfloat16", max_seq_len=24,
                 shard_rows=48, rows_per_unit=5)
NUM_UNITS = 6
SCRIPT = Path(__file__).with_name("crash_writer.py")


def _start(uri: str, options: dict[str, Any], *extra: str) -> subprocess.Popen[str]:
    spec = json.dumps(dataclasses.asdict(SPEC))
    return subprocess.Popen([sys.executable, "-P", str(SCRIPT), uri, str(NUM_UNITS), spec,
                             "--options", json.dumps(options), *extra],
                            stdout=subprocess.PIPE, text=True)


def _kill_when(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdout is not None
    for got in proc.stdout:
        if got.strip() == line:
            os.kill(proc.pid, signal.SIGKILL)
            break
    assert proc.wait(timeout=60) == -signal.SIGKILL, f"writer ended before printing {line!r}"


def _finish(uri: str, options: dict[str, Any]) -> None:
    proc = _start(uri, options)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out


def _contents(uri: str, options: dict[str, Any]) -> dict[int, dict[str, np.ndarray]]:
    finalize_cache(uri, expected_units=NUM_UNITS, storage_options=options)
    reader = open_cache(uri, storage_options=options, verify=True)
    out: dict[int, dict[str, np.ndarray]] = {}
    for unit in reader.unit_ids().tolist():
        for s in reader.read_unit(unit):
            assert s.sample_id not in out, f"sample {s.sample_id} read twice"
            out[s.sample_id] = {k: v for k, v in dataclasses.asdict(s).items()
                                if isinstance(v, np.ndarray)}
    assert reader.samples.sample_id.tolist() == sorted(out)
    return out


def _crash_and_resume(uri: str, reference: str, options: dict[str, Any]) -> None:
    # 1. killed while parked between its slot writes and the commit record of unit 2
    _kill_when(_start(uri, options, "--stall-before-commit", "2"), "stalled 2")
    assert CacheWriter.open(uri, spec=SPEC, header=make_run_header(SPEC),
                            storage_options=options).committed_units() == {0, 1}
    # 2. killed at a racy point: right after committing unit 3, while unit 4 is being written
    _kill_when(_start(uri, options), "committed 3")
    # 3. resumed to the end
    _finish(uri, options)
    _assert_same(uri, reference, options)


def _assert_same(uri: str, reference: str, options: dict[str, Any]) -> None:
    got, want = _contents(uri, options), _contents(reference, options)
    assert sorted(got) == sorted(want)
    for sid, arrays in want.items():
        for name, values in arrays.items():
            np.testing.assert_array_equal(got[sid][name], values, err_msg=f"{sid} {name}")


def _reference(uri: str, options: dict[str, Any]) -> None:
    writer = CacheWriter.open(uri, spec=SPEC, header=make_run_header(SPEC), storage_options=options)
    for unit in range(NUM_UNITS):
        writer.write_unit(unit, *make_unit(SPEC, unit))


@pytest.mark.slow
def test_sigkill_then_resume_local(tmp_path: Path) -> None:
    """Killed twice mid-run on local disk, resumed: every sample exactly once, identical bytes."""
    _reference(str(tmp_path / "ref"), {})
    _crash_and_resume(str(tmp_path / "cache"), str(tmp_path / "ref"), {})


@pytest.mark.slow
def test_sigkill_with_full_write_queue_loses_only_units_in_flight(tmp_path: Path) -> None:
    """Killed with the write queue full: only units in flight are lost, the resume is exact."""
    uri, queue_units = str(tmp_path / "cache"), 2
    _reference(str(tmp_path / "ref"), {})
    proc = _start(uri, {}, "--queue_units", str(queue_units), "--stall-before-commit", "1")
    assert proc.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(x.strip() for x in proc.stdout),
                              daemon=True)  # type: ignore[union-attr]
    reader.start()
    full = {"stalled 1", f"queued {1 + queue_units}"}  # unit 1 parked; units 2, 3 queued
    deadline = time.monotonic() + 60
    while not full <= set(lines) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert full <= set(lines), lines
    time.sleep(1.0)  # submitting the next unit must block on the full queue
    assert f"queued {2 + queue_units}" not in lines, lines
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    writer = CacheWriter.open(uri, spec=SPEC, header=make_run_header(SPEC))
    assert writer.committed_units() == {0}  # lost: unit 1 (writing) + 2, 3 (queued)
    _finish(uri, {})
    _assert_same(uri, str(tmp_path / "ref"), {})


@pytest.mark.slow
def test_sigkill_with_two_writer_threads_loses_only_the_unit_in_flight(tmp_path: Path) -> None:
    """Two writer threads, one parked before unit 1's commit while the other commits units 2 and
    3 past it: a SIGKILL loses unit 1 only, and the resume is exact."""
    uri = str(tmp_path / "cache")
    _reference(str(tmp_path / "ref"), {})
    proc = _start(uri, {}, "--queue_units", "1", "--writer_threads", "2",
                  "--stall-before-commit", "1")
    assert proc.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(x.strip() for x in proc.stdout),
                              daemon=True)  # type: ignore[union-attr]
    reader.start()
    past = {"stalled 1", "committed 3"}  # the other thread went on while unit 1 is parked
    deadline = time.monotonic() + 60
    while not past <= set(lines) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert past <= set(lines), lines
    committed = CacheWriter.open(uri, spec=SPEC, header=make_run_header(SPEC)).committed_units()
    assert {0, 2, 3} <= committed
    assert 1 not in committed
    _finish(uri, {})
    _assert_same(uri, str(tmp_path / "ref"), {})


@pytest.mark.slow
def test_sigkill_then_resume_s3(moto_server: dict[str, Any]) -> None:
    """The same crash/resume through s3fs against a moto S3 server on 127.0.0.1."""
    options = moto_server["storage_options"]
    prefix = f"s3://{moto_server['bucket']}/{uuid.uuid4().hex}"
    _reference(f"{prefix}/ref", options)
    _crash_and_resume(f"{prefix}/cache", f"{prefix}/ref", options)


@pytest.mark.slow
def test_sigterm_stops_produce_saying_what_it_kept(tiny_target: Path, tmp_path: Path) -> None:
    """A real SIGTERM to a real ``sparkforge produce`` mid-run: exit 143 and one line naming the
    units committed and the one abandoned (it used to die silently); the re-run completes a
    cache equal, byte for byte, to an uninterrupted one."""
    from producer_helpers import assert_same_samples, cache_samples, chat_rows, write_jsonl

    from sparkforge.app.cli import main

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))
    args = ["produce", "--backend", "hf", "--data", str(data), "--layer_ids", "[0, 1, 2]",
            "--hidden_dtype", "float32", "--rows_per_unit", "2", "--shard_rows", "256",
            "--progress", "false", "--writer_threads", "1", "--engine.model", str(tiny_target),
            "--engine.max_model_len", "128", "--engine.dtype", "float32"]
    assert main([*args, "--output", str(tmp_path / "ref")]) == 0
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-P", "-m", "sparkforge.app.cli", *args,
                             "--output", str(cache)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(proc, lambda: len(list((cache / "_commits").glob("*/unit_*.json"))) >= 2,
                   "its second commit", poll_s=0.02)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("sparkforge produce: stopped by SIGTERM: "), last
    done = int(last.split("stopped by SIGTERM: ")[1].split(" of ")[0])
    assert f"{done} of this worker's 12 units to do are committed" in last
    assert ("was being captured and is abandoned" in last) or ("no unit was abandoned" in last)
    committed = len(list((cache / "_commits").glob("*/unit_*.json")))
    assert 2 <= committed == done < 12, (committed, last)
    assert not (cache / "manifest.json").exists()
    assert main([*args, "--output", str(cache)]) == 0
    assert_same_samples(cache_samples(str(cache)), cache_samples(str(tmp_path / "ref")))
    assert main(["validate", "--deep", str(cache)]) == 0
