"""sparkforge status on caches written by the real writer: in progress, unfinalized, finalized."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from cache_helpers import SMALL_SPEC, build_cache, make_header, make_unit

import sparkforge.manifests.status as status_module
from sparkforge.app.cli import main
from sparkforge.manifests.finalize import finalize_cache
from sparkforge.manifests.status import StatusReader
from sparkforge.shared import storage
from sparkforge.shared.header import RunHeader
from sparkforge.shared.layout import CacheSpec, attempt_key, commit_key, units_per_group
from sparkforge.shared.writer import CacheWriter

NUM_UNITS = 4


def run_header(spec: CacheSpec, num_units: int) -> RunHeader:
    """The test header plus the unit count ``sparkforge produce`` records."""
    header = make_header(spec)
    header["producer_config"]["resolved"] = {"num_units": num_units}
    return RunHeader.from_json(header)


def expected_counts(units: list[int]) -> tuple[int, int]:
    """Samples and tokens of ``make_unit`` for ``units``, counted from the records themselves."""
    records = [r for u in units for r in make_unit(SMALL_SPEC, u)[0]]
    return len(records), sum(r.num_tokens for r in records)


def set_time(path: Path, t: float) -> None:
    """Pin an object's modification time (the store's commit / claim time)."""
    os.utime(path, (t, t))


@pytest.fixture
def running(tmp_path: Path) -> Path:
    """4 units, 2 workers: units 0, 1, 3 committed at t=1100/1200/1300 (claims at t=1000), unit 1
    on its second attempt, unit 2 claimed but not committed (a worker is writing it or died)."""
    root = tmp_path / "cache"
    writer = CacheWriter.open(str(root), spec=SMALL_SPEC, header=run_header(SMALL_SPEC, NUM_UNITS))
    # abandoned by a killed worker
    storage.exclusive_create(writer.loc, attempt_key(SMALL_SPEC, 1, 0), b"")
    for unit in (0, 1, 3):
        writer.write_unit(unit, *make_unit(SMALL_SPEC, unit))
    storage.exclusive_create(writer.loc, attempt_key(SMALL_SPEC, 2, 0), b"")
    for path in (root / "_attempts").rglob("*"):
        if path.is_file():
            set_time(path, 1000.0)
    for unit, t in ((0, 1100.0), (1, 1200.0), (3, 1300.0)):
        set_time(root / commit_key(SMALL_SPEC, unit), t)
    return root


def test_running_cache_counts_units_samples_tokens_and_shares(running: Path) -> None:
    """A run in progress: committed/missing per share u % N == w, samples and tokens so far."""
    status = StatusReader.open(str(running), num_workers=2).read(now=1400.0)
    samples, tokens = expected_counts([0, 1, 3])
    assert status["state"] == "running"
    assert status["units"] == {"total": 4, "committed": 3, "missing": 1, "in_flight": 1}
    assert (status["samples"], status["tokens"]) == (samples, tokens)
    assert status["input_rows"] == 3 * SMALL_SPEC.rows_per_unit
    assert status["skipped"] == status["input_rows"] - samples
    w0, w1 = status["workers"]
    assert (w0["owned"], w0["committed"], w0["missing"], w0["in_flight"], w0["state"]) == \
        (2, 1, 1, [2], "working")
    assert (w1["owned"], w1["committed"], w1["missing"], w1["state"]) == (2, 2, 0, "done")
    assert w1["tokens"] == expected_counts([1, 3])[1]
    assert w1["idle_s"] == pytest.approx(100.0)
    assert [(a["unit"], a["attempt"]) for a in status["in_flight"]] == [(2, 0)]
    assert status["in_flight"][0]["age_s"] == pytest.approx(400.0)
    assert [(a["unit"], a["attempt"]) for a in status["abandoned"]] == [(1, 0)]
    assert status["problems"] == []


def test_throughput_and_eta_from_commit_times(running: Path) -> None:
    """Rates count from the first claim (t=1000); the window holds the commits after 1300 - 150;
    the ETA is the missing units over the recent unit rate."""
    tp = StatusReader.open(str(running), window_s=150.0).read(now=1400.0)["throughput"]
    _, tokens = expected_counts([0, 1, 3])
    _, recent_tokens = expected_counts([1, 3])
    assert tp["elapsed_s"] == pytest.approx(300.0)
    assert tp["overall"]["units_per_s"] == pytest.approx(3 / 300)
    assert tp["overall"]["tokens_per_s"] == pytest.approx(tokens / 300)
    assert tp["recent"]["units_per_s"] == pytest.approx(2 / 150)
    assert tp["recent"]["tokens_per_s"] == pytest.approx(recent_tokens / 150)
    assert tp["eta_s"] == pytest.approx(1 / (2 / 150))
    assert tp["idle_s"] == pytest.approx(100.0)
    assert tp["last_commit_at"] == "1970-01-01T00:21:40+00:00"


def test_all_committed_but_not_finalized_then_finalized(running: Path) -> None:
    """Every unit committed without a manifest is 'unfinalized'; after finalize, 'finalized'."""
    writer = CacheWriter.open(str(running), spec=SMALL_SPEC,
                              header=run_header(SMALL_SPEC, NUM_UNITS))
    writer.write_unit(2, *make_unit(SMALL_SPEC, 2))
    reader = StatusReader.open(str(running), num_workers=2)
    status = reader.read()
    assert status["state"] == "unfinalized"
    assert status["units"] == {"total": 4, "committed": 4, "missing": 0, "in_flight": 0}
    assert status["throughput"]["eta_s"] == 0.0
    finalize_cache(str(running), expected_units=NUM_UNITS)
    status = reader.read()
    assert status["state"] == "finalized"
    assert (status["samples"], status["tokens"]) == expected_counts([0, 1, 2, 3])


def test_finalized_cache_without_unit_count_in_header(tmp_path: Path) -> None:
    """A finished cache whose header lacks the unit count takes it from the manifest."""
    root = build_cache(tmp_path / "cache")
    status = StatusReader.open(str(root)).read()
    assert status["state"] == "finalized"
    assert status["units"]["total"] == 3
    assert (status["samples"], status["tokens"]) == expected_counts([0, 1, 2])


def test_unreadable_commit_record_is_a_problem_not_a_crash(running: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """A corrupt commit record is reported by unit (exit 1); the other units still count."""
    (running / commit_key(SMALL_SPEC, 3)).write_bytes(b"{not json")
    assert main(["status", str(running), "--json"]) == 1
    status = json.loads(capsys.readouterr().out)
    assert status["units"]["committed"] == 3
    assert status["samples"] == expected_counts([0, 1])[0]
    assert len(status["problems"]) == 1
    assert status["problems"][0].startswith("unit 3: commit record cannot be read")


def test_oversized_commit_record_is_a_problem(running: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit record over the size cap is a problem naming its unit; the others still count."""
    import sparkforge.manifests.status as status_module

    path = running / commit_key(SMALL_SPEC, 3)
    cap = max(len((running / commit_key(SMALL_SPEC, u)).read_bytes()) for u in (0, 1, 3))
    monkeypatch.setattr(status_module, "MAX_COMMIT_BYTES", cap)
    path.write_bytes(path.read_bytes() + b" " * 10_000)  # still valid JSON, over the cap
    status = StatusReader.open(str(running), num_workers=2).read()
    assert status["problems"] == [
        f"unit 3: commit record cannot be read: larger than the {cap:,} bytes allowed"]
    assert status["samples"] == expected_counts([0, 1])[0]


def test_cli_table_and_exit_codes(running: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Text names the state, units and each worker; missing path 2, not a cache 1, bad flag 2."""
    assert main(["status", str(running), "--num_workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "RUNNING" in out
    assert "3 / 4 committed, 1 missing, 1 in flight" in out
    assert re.search(r"working, unit 2 claimed \d+h \d\dm ago", out)
    assert "abandoned    1 attempt (units 1)" in out
    assert main(["status", str(tmp_path / "nope")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["status", str(tmp_path / "empty")]) == 1
    assert "not a sparkforge cache" in capsys.readouterr().err
    assert main(["status", str(running), "--num_workers", "0"]) == 2


def test_watch_refreshes_until_finalized(running: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--watch --json prints one JSON line per refresh and stops once the cache is finalized."""
    def finish() -> None:
        writer = CacheWriter.open(str(running), spec=SMALL_SPEC,
                                  header=run_header(SMALL_SPEC, NUM_UNITS))
        writer.write_unit(2, *make_unit(SMALL_SPEC, 2))
        finalize_cache(str(running), expected_units=NUM_UNITS)

    worker = threading.Timer(0.3, finish)
    worker.start()
    try:
        assert main(["status", str(running), "--json", "--watch", "0.05"]) == 0
    finally:
        worker.join()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) >= 2
    assert lines[0]["state"] == "running"
    assert lines[-1]["state"] == "finalized"
    assert lines[-1]["units"]["committed"] == NUM_UNITS


@pytest.mark.slow
def test_status_on_s3(moto_server: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """Through s3fs: a run in progress, then finished; times come from S3's LastModified."""
    options = moto_server["storage_options"]
    uri = f"s3://{moto_server['bucket']}/{uuid.uuid4().hex}"
    writer = CacheWriter.open(uri, spec=SMALL_SPEC, header=run_header(SMALL_SPEC, 3),
                              storage_options=options)
    writer.write_unit(0, *make_unit(SMALL_SPEC, 0))
    writer.write_unit(2, *make_unit(SMALL_SPEC, 2))
    flags = ["--storage_options", json.dumps(options), "--num_workers", "3", "--json"]

    assert main(["status", uri, *flags]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["state"] == "running"
    assert status["units"] == {"total": 3, "committed": 2, "missing": 1, "in_flight": 0}
    assert [w["state"] for w in status["workers"]] == ["done", "waiting", "done"]
    assert (status["samples"], status["tokens"]) == expected_counts([0, 2])
    assert status["throughput"]["last_commit_at"] is not None
    assert status["throughput"]["started_at"] <= status["throughput"]["last_commit_at"]

    writer.write_unit(1, *make_unit(SMALL_SPEC, 1))
    finalize_cache(uri, expected_units=3, storage_options=options)
    assert main(["status", uri, *flags]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["state"] == "finalized"
    assert (status["samples"], status["tokens"]) == expected_counts([0, 1, 2])


GROUPED_SPEC = dataclasses.replace(SMALL_SPEC, max_seq_len=32 * 20_000, rows_per_unit=2)
"""2 units a group: 40,000 slots an attempt (of the 100,000 a group folder holds), so a cache of a
few short samples spans several group folders."""


@pytest.mark.parametrize("where", ["local", "s3"])
def test_status_lists_every_group_folder_and_counts_across_them(
        where: str, tmp_path: Path, moto_server: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """8 units in 4 groups, listed 2 folders at a time: units 0, 1, 2, 4, 6 committed (unit 1 on
    its second attempt, its first abandoned), 3 and 7 claimed only, 5 untouched. Every group
    folder of ``_commits/`` and ``_attempts/`` is listed once and what each holds is counted."""
    assert units_per_group(GROUPED_SPEC) == 2
    options = moto_server["storage_options"] if where == "s3" else None
    uri = (f"s3://{moto_server['bucket']}/{uuid.uuid4().hex}" if where == "s3"
           else str(tmp_path / "cache"))
    writer = CacheWriter.open(uri, spec=GROUPED_SPEC, header=run_header(GROUPED_SPEC, 8),
                              storage_options=options)
    storage.exclusive_create(writer.loc, attempt_key(GROUPED_SPEC, 1, 0), b"")
    committed = [0, 1, 2, 4, 6]
    for unit in committed:
        writer.write_unit(unit, *make_unit(GROUPED_SPEC, unit, lengths=[3, 5]))
    for unit in (3, 7):
        storage.exclusive_create(writer.loc, attempt_key(GROUPED_SPEC, unit, 0), b"")
    listed: list[str] = []
    real = status_module.object_times

    def recording(loc: storage.Location, folder: str) -> dict[str, float | None]:
        listed.append(folder)
        return real(loc, folder)

    monkeypatch.setattr(status_module, "object_times", recording)
    reader = StatusReader.open(uri, storage_options=options)
    reader.max_concurrency = 2
    status = reader.read()
    assert sorted(listed) == [f"{prefix}/{g}" for prefix in ("_attempts", "_commits")
                              for g in range(4)]
    assert status["problems"] == []
    assert status["units"] == {"total": 8, "committed": 5, "missing": 3, "in_flight": 2}
    assert [(a["unit"], a["attempt"]) for a in status["in_flight"]] == [(3, 0), (7, 0)]
    assert [(a["unit"], a["attempt"]) for a in status["abandoned"]] == [(1, 0)]
    records = [r for u in committed for r in make_unit(GROUPED_SPEC, u, lengths=[3, 5])[0]]
    assert (status["samples"], status["tokens"]) == (len(records),
                                                     sum(r.num_tokens for r in records))
