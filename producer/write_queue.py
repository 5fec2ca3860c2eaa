"""Write captured units on background threads while the engine captures the next ones.

Capture (GPU) and compression (CPU) overlap: the capture loop hands each finished unit to a
bounded queue and goes on; ``num_threads`` writer threads take units from it and call
``CacheWriter.write_unit``, which commits each one atomically, so units commit in order of
completion; a unit another process committed first comes back marked ``taken_over``. Several
threads are what spreads the writer over cores: zarr compresses the chunks of one array write in
parallel, but one unit's copies into shard buffers, shard assembly and checksums run one after
another, so one thread keeps about one core busy (each thread has its own shard buffers). Memory is
bounded: the queue never holds more than ``queue_units`` units, so at most
``queue_units + num_threads + 1`` units (waiting, being written, being captured) are in memory at
once; ``submit`` blocks while the queue is full. A crash loses at most those units, which a re-run
redoes.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import TracebackType

from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.records import SampleRecord, UnitAccounting
from sparkforge.shared.writer import CacheWriter, UnitAlreadyCommitted

logger = logging.getLogger(__name__)


def default_writer_threads(*, cpus: int, engine_processes: int) -> int:
    """Compression threads for the CPUs left after the engine and the capture loop (>= 1).

    Args:
        cpus: CPUs this process may use.
        engine_processes: CPU-bound engine processes (vLLM: one per GPU worker plus its
            scheduler; 0 for an in-process transformers forward).
    """
    return max(1, cpus - engine_processes - 1)


@dataclass(frozen=True)
class CapturedUnit:
    """One unit's records and accounting, as the capture loop produced them."""

    unit: int
    records: Sequence[SampleRecord]
    accounting: UnitAccounting
    taken_over: bool = False
    """Another process committed the unit first; these records were not written."""


class UnitWriteQueue:
    """A bounded queue of captured units drained by writer threads; use as a context manager.

    Args:
        writer: The open cache writer (safe for disjoint units on several threads).
        queue_units: Most units waiting in the queue (>= 1).
        num_threads: Writer threads, i.e. units written at once (>= 1).
    """

    def __init__(self, writer: CacheWriter, *, queue_units: int, num_threads: int) -> None:
        if queue_units < 1 or num_threads < 1:
            raise SparkforgeError(
                f"queue_units and num_threads must be >= 1, got {queue_units} and "
                f"{num_threads}")
        self._writer = writer
        self._queue: queue.Queue[CapturedUnit | None] = queue.Queue(maxsize=queue_units)
        self._committed: queue.SimpleQueue[CapturedUnit] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._work, name=f"unit-writer-{i}", daemon=True)
                         for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, item: CapturedUnit) -> list[CapturedUnit]:
        """Queue a unit (blocks while the queue is full); returns the units committed since the
        last call, in commit order.

        Raises:
            The first error a writer thread hit; nothing more is written after it.
        """
        while True:
            self._raise_if_failed()
            try:
                self._queue.put(item, timeout=0.1)
                return self.committed()
            except queue.Full:
                continue

    def committed(self) -> list[CapturedUnit]:
        """Units committed since the last call, in commit order."""
        out = []
        while not self._committed.empty():
            out.append(self._committed.get())
        return out

    def close(self) -> list[CapturedUnit]:
        """Write every queued unit, stop the threads; returns the units committed since the last
        call. Raises the first writer error, if any."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._raise_if_failed()
        return self.committed()

    def __enter__(self) -> UnitWriteQueue:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            return
        # The capture loop failed: units already captured are good data, so they are still
        # written (a re-run would otherwise redo them); the capture error is what propagates.
        try:
            self.close()
        except Exception as write_error:
            if exc is None or write_error not in (exc, exc.__cause__):  # not the same failure
                logger.error("a unit write failed while the run was stopping: %s", write_error)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain without writing after a failure
            try:
                self._writer.write_unit(item.unit, item.records, item.accounting)
            except UnitAlreadyCommitted:
                item = replace(item, taken_over=True)
            except BaseException as exc:  # handed to the capture thread, which raises it
                self._error = exc
                continue
            self._committed.put(item)
