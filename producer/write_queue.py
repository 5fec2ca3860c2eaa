"""Write captured units on background threads while the engine captures the next ones.

Capture (GPU) and compression (CPU) overlap. The capture loop ``open``s a unit before capturing
it and feeds the returned ``UnitFeed`` its samples, block of rows by block (a chunk of a long
sample, or a whole sample), then commits it; ``num_threads`` writer threads take units from a
bounded queue and write each unit's blocks as they come through ``CacheWriter.open_unit``,
committing the unit once all its blocks are written, so units commit in order of completion; a
unit another process committed first comes back marked ``taken_over``. (``submit`` queues a unit
of whole records, written with ``CacheWriter.write_unit``.) Several threads are what spreads the
writer over cores: zarr compresses the chunks of one array write in parallel, but one unit's
copies into shard buffers, shard assembly and checksums run one after another, so one thread keeps
about one core busy (each thread has its own shard buffers). Memory is bounded by blocks, not by
samples or units: at most ``queue_units`` units wait for a thread, each unit's feed holds at most
``FEED_BLOCKS`` blocks, and only the unit being captured gains blocks, so at most
``(queue_units + num_threads + 1) x FEED_BLOCKS`` blocks wait, besides the one being written by
each thread and the one being captured. A crash commits nothing of the unit being captured nor of
those not yet committed; a re-run redoes them.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

from sparkforge.producer.summary import UnitTally, nbytes
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.layout import CacheSpec, array_layouts
from sparkforge.shared.records import SampleRecord, SampleRows, SampleStart, UnitAccounting
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


def writer_memory_bytes(spec: CacheSpec, *, threads: int, in_flight_bytes: int) -> int:
    """Most host memory the writer threads hold besides the blocks waiting for them: per thread,
    its shard buffers (``shard_rows`` rows of every array) and the encoded slot objects it has
    in flight, ``in_flight_bytes`` or one object if larger (taken at its raw size)."""
    shards = [spec.shard_rows * a.dtype.itemsize * math.prod(a.row_shape)
              for a in array_layouts(spec).values()]
    return threads * (sum(shards) + max(in_flight_bytes, max(shards)))


FEED_BLOCKS = 2
"""Blocks of rows (a chunk, or a whole sample) a streamed unit holds waiting for its writer."""


@dataclass(frozen=True)
class CapturedUnit:
    """One unit's records and accounting, as the capture loop produced them."""

    unit: int
    records: Sequence[SampleRecord]
    accounting: UnitAccounting
    taken_over: bool = False
    """Another process committed the unit first; these records were not written."""
    tally: UnitTally | None = None
    """What the committed samples hold (set on the units the queue reports committed)."""


class UnitFeed:
    """A unit streamed to a writer thread while it is captured: a ``SampleSink`` whose calls
    wait in a queue of ``FEED_BLOCKS`` blocks, then ``commit`` (or ``cancel``: nothing of the
    unit is committed). Made by ``UnitWriteQueue.open``; used from the capture thread."""

    def __init__(self, unit: int, check: Callable[[], None]) -> None:
        self.unit = unit
        self.ops: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=FEED_BLOCKS)
        self.tally = UnitTally()
        self.closed = False
        self.taken = False
        """Whether the writer thread took its ``commit`` or ``cancel`` (nothing left to drain)."""
        self._check = check
        self._open: list[int] = []  # the open sample's id, tokens, loss tokens and bytes

    def begin(self, start: SampleStart) -> None:
        """Start a sample."""
        self._open = [start.sample_id, start.num_tokens, int(start.loss_mask.sum()),
                      nbytes(start.input_ids, start.loss_mask)]
        self._put("begin", start)

    def add(self, rows: SampleRows) -> None:
        """The sample's next rows (blocks while ``FEED_BLOCKS`` wait)."""
        self._open[3] += nbytes(rows.aux_hidden, rows.aux_scale, rows.final_hidden,
                                rows.topk_ids, rows.topk_logprobs)
        self._put("add", rows)

    def end(self) -> None:
        """The sample is whole."""
        sample_id, tokens, loss_tokens, size = self._open
        self.tally.sample_ids.append(sample_id)
        self.tally.tokens += tokens
        self.tally.loss_tokens += loss_tokens
        self.tally.bytes_raw += size
        self._put("end", None)

    def abandon(self) -> None:
        """Drop the sample and the rows it was given."""
        self._put("abandon", None)

    def commit(self, accounting: UnitAccounting) -> None:
        """Commit the unit once its writer has written every block."""
        self.closed = True
        self._put("commit", accounting)

    def cancel(self) -> None:
        """Give the unit up: its writer stops without committing it."""
        if not self.closed:
            self.closed = True
            self.ops.put(("cancel", None))  # the writer drains its feed even after a failure

    def _put(self, op: str, value: Any) -> None:
        while True:
            self._check()  # raises a writer thread's error
            try:
                self.ops.put((op, value), timeout=0.1)
                return
            except queue.Full:
                continue


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
        self._queue: queue.Queue[CapturedUnit | UnitFeed | None] = queue.Queue(
            maxsize=queue_units)
        self._committed: queue.SimpleQueue[CapturedUnit] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._feeds: list[UnitFeed] = []
        self._threads = [threading.Thread(target=self._work, name=f"unit-writer-{i}", daemon=True)
                         for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, item: CapturedUnit) -> list[CapturedUnit]:
        """Queue a whole unit (blocks while the queue is full); returns the units committed
        since the last call, in commit order.

        Raises:
            The first error a writer thread hit; nothing more is written after it.
        """
        self._put(item)
        return self.committed()

    def open(self, unit: int) -> UnitFeed:
        """Queue a unit to stream while it is captured (blocks while the queue is full): feed
        it its samples, then ``commit`` it, or ``cancel`` it on failure.

        Raises:
            The first error a writer thread hit (also from the feed's calls).
        """
        feed = UnitFeed(unit, self._raise_if_failed)
        self._put(feed)
        self._feeds = [*(f for f in self._feeds if not f.closed), feed]
        return feed

    def _put(self, item: CapturedUnit | UnitFeed) -> None:
        while True:
            self._raise_if_failed()
            try:
                self._queue.put(item, timeout=0.1)
                return
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
        for feed in self._feeds:  # a feed left open (its capture failed) is given up
            feed.cancel()
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
                if isinstance(item, UnitFeed):
                    _drain(item)
                continue  # drain without writing after a failure
            try:
                done = (self._write_feed(item) if isinstance(item, UnitFeed) else
                        self._write_whole(item))
            except BaseException as exc:  # handed to the capture thread, which raises it
                self._error = exc
                if isinstance(item, UnitFeed) and not item.taken:
                    _drain(item)
                continue
            if done is not None:
                self._committed.put(done)

    def _write_whole(self, item: CapturedUnit) -> CapturedUnit:
        try:
            self._writer.write_unit(item.unit, item.records, item.accounting)
        except UnitAlreadyCommitted:
            return replace(item, taken_over=True)
        return replace(item, tally=UnitTally.of(item.records))

    def _write_feed(self, feed: UnitFeed) -> CapturedUnit | None:
        """Write a streamed unit as its blocks come; None if it was cancelled."""
        try:
            stream = self._writer.open_unit(feed.unit)
        except UnitAlreadyCommitted:
            stream = None
        while True:
            op, value = feed.ops.get()
            feed.taken = op in ("commit", "cancel")
            if op == "cancel":
                return None
            if op == "commit":
                break
            if stream is not None:
                getattr(stream, op)(*([] if value is None else [value]))
        done = CapturedUnit(feed.unit, (), value, taken_over=stream is None, tally=feed.tally)
        if stream is not None:
            try:
                stream.commit(value)
            except UnitAlreadyCommitted:
                return replace(done, taken_over=True)
        return done


def _drain(feed: UnitFeed) -> None:
    """Take a feed's blocks until its end, writing nothing (its capture thread is not left
    waiting on a full feed)."""
    while feed.ops.get()[0] not in ("commit", "cancel"):
        continue
