"""The background write queue: bounded memory, commits as units finish, errors surface."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from cache_helpers import SMALL_FP8_SPEC, SMALL_SPEC, make_run_header, make_unit

from sparkforge.producer.write_queue import (
    CapturedUnit,
    UnitWriteQueue,
    default_writer_threads,
    writer_memory_bytes,
)
from sparkforge.shared.layout import CacheSpec
from sparkforge.shared.records import SampleRecord, UnitAccounting
from sparkforge.shared.writer import CacheWriter


class GatedWriter(CacheWriter):
    """A real cache writer whose ``write_unit`` waits for a gate (and can be told to fail)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.started: list[int] = []
        self.fail_unit = -1

    def write_unit(self, unit: int, samples: Sequence[SampleRecord],
                   accounting: UnitAccounting) -> None:
        """Announce the unit, wait for the gate, then write it for real (or fail)."""
        self.started.append(unit)
        assert self.gate.wait(timeout=30)
        if unit == self.fail_unit:
            raise OSError(f"disk full while writing unit {unit}")
        super().write_unit(unit, samples, accounting)


def _writer(path: Path) -> GatedWriter:
    writer = GatedWriter.open(str(path), spec=SMALL_SPEC, header=make_run_header(SMALL_SPEC))
    assert isinstance(writer, GatedWriter)
    return writer


def _unit(u: int) -> CapturedUnit:
    samples, accounting = make_unit(SMALL_SPEC, u)
    return CapturedUnit(u, samples, accounting)


def _submit_in_thread(writes: UnitWriteQueue, item: CapturedUnit,
                      reported: list[CapturedUnit]) -> threading.Thread:
    thread = threading.Thread(target=lambda: reported.extend(writes.submit(item)), daemon=True)
    thread.start()
    return thread


def test_submit_blocks_while_the_queue_holds_queue_units(tmp_path: Path) -> None:
    """With the writer busy, the queue takes queue_units units and the next submit waits."""
    writer = _writer(tmp_path / "c")
    writes = UnitWriteQueue(writer, queue_units=1, num_threads=1)
    writes.submit(_unit(0))  # taken by the writer thread, which waits at the gate
    while writer.started != [0]:
        threading.Event().wait(0.01)
    writes.submit(_unit(1))  # fills the queue
    reported: list[CapturedUnit] = []
    blocked = _submit_in_thread(writes, _unit(2), reported)
    blocked.join(timeout=0.5)
    assert blocked.is_alive(), "submit returned although the queue was full"
    assert writes._queue.qsize() == 1  # never more than queue_units waiting
    writer.gate.set()
    blocked.join(timeout=30)
    reported += writes.close()
    assert not blocked.is_alive()
    assert writer.committed_units() == {0, 1, 2}
    assert [d.unit for d in reported] == [0, 1, 2]  # reported once each, in commit order


def test_a_writer_error_is_raised_to_the_capture_loop(tmp_path: Path) -> None:
    """A failed write surfaces on the next submit or on close; later units are not written."""
    writer = _writer(tmp_path / "c")
    writer.fail_unit = 1
    writer.gate.set()
    writes = UnitWriteQueue(writer, queue_units=1, num_threads=1)
    with pytest.raises(OSError, match="disk full while writing unit 1"):  # noqa: PT012
        for u in range(3):
            writes.submit(_unit(u))
        writes.close()
    with pytest.raises(OSError, match="unit 1"):
        writes.close()
    assert writer.committed_units() == {0}


def test_units_captured_before_a_capture_error_are_still_committed(tmp_path: Path) -> None:
    """Leaving the context on a capture error writes the queued units, then re-raises."""
    writer = _writer(tmp_path / "c")
    writer.gate.set()
    with pytest.raises(RuntimeError, match="engine died"), UnitWriteQueue(  # noqa: PT012
            writer, queue_units=2, num_threads=1) as writes:
        writes.submit(_unit(0))
        writes.submit(_unit(1))
        raise RuntimeError("engine died")
    assert writer.committed_units() == {0, 1}


def _stored_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("spec", [SMALL_SPEC, SMALL_FP8_SPEC], ids=["lossless", "fp8"])
def test_several_writer_threads_store_the_bytes_one_thread_stores(tmp_path: Path,
                                                                   spec: CacheSpec) -> None:
    """Units written by 3 threads at once give the same objects, byte for byte, as 1 thread."""
    units = [CapturedUnit(u, *make_unit(spec, u)) for u in range(8)]
    stores = {}
    for threads in (1, 3):
        path = tmp_path / f"threads{threads}"
        writer = CacheWriter.open(str(path), spec=spec,
                                  header=make_run_header(spec, num_units=len(units)))
        with UnitWriteQueue(writer, queue_units=2, num_threads=threads) as writes:
            for item in units:
                writes.submit(item)
            done = writes.close()
        assert writer.committed_units() == set(range(len(units)))
        assert not any(d.taken_over for d in done)
        stores[threads] = _stored_files(path)
    assert any(name.startswith("aux_hidden") and "/c/" in name for name in stores[1])
    assert stores[3] == stores[1]


@pytest.mark.parametrize(("cpus", "engine", "expected"), [(16, 2, 13), (2, 2, 1), (8, 0, 7)])
def test_default_writer_threads_leave_the_engine_its_cores(cpus: int, engine: int,
                                                           expected: int) -> None:
    """Writer threads are the CPUs minus engine processes minus the capture loop, at least 1."""
    assert default_writer_threads(cpus=cpus, engine_processes=engine) == expected


def test_writer_memory_counts_each_threads_buffers_and_slot_objects_in_flight() -> None:
    """Per thread: one shard of rows of every array (SMALL_SPEC: 32 rows of 2 bf16 aux layers
    and the final hidden state at H=16, int32 ids, uint8 mask: 101 bytes a row) and the bytes in
    flight, or one shard object (the largest: 32 rows x 32 bytes) when the bound is smaller."""
    buffers = 32 * (3 * 16 * 2 + 4 + 1)
    assert writer_memory_bytes(SMALL_SPEC, threads=3, in_flight_bytes=10_000) == 3 * (buffers
                                                                                   + 10_000)
    assert writer_memory_bytes(SMALL_SPEC, threads=3, in_flight_bytes=1) == 3 * (buffers
                                                                               + 32 * 32)
