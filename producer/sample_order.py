"""Hand a unit's captured samples to the writer in sample-id order, chunk by chunk as they come.

A source returns samples in completion order (vLLM) and a long sample as consecutive chunks (the
transformers backend), while the writer packs a unit's samples in sample-id order, so that a
resumed cache has the same bytes as an uninterrupted one. ``InOrder`` passes the rows of the
next sample in that order straight to the sink as they arrive, and holds those of later samples
until their turn: a source that answers in order (the transformers backend) has nothing held, so
host memory holds one chunk; one that answers out of order holds the samples that finished early.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from sparkforge.shared.records import SampleRows, SampleStart


class SampleSink(Protocol):
    """Takes a unit's samples in order, each in blocks of rows (``UnitStream`` is one)."""

    def begin(self, start: SampleStart) -> None:
        """Start a sample."""
        ...

    def add(self, rows: SampleRows) -> None:
        """The started sample's next rows."""
        ...

    def end(self) -> None:
        """The started sample is whole."""
        ...

    def abandon(self) -> None:
        """Drop the started sample and the rows it was given."""
        ...


class InOrder:
    """Feeds ``sink`` the samples of ``starts`` (ascending sample ids) in that order.

    Args:
        sink: Where the samples go.
        starts: Every sample of the unit that may be written, in the order to write them.
    """

    def __init__(self, sink: SampleSink, starts: Sequence[SampleStart]) -> None:
        self._sink = sink
        self._starts = list(starts)
        self._head = 0
        self._begun = False
        self._held: dict[int, list[SampleRows]] = {}
        self._complete: set[int] = set()
        self._dropped: set[int] = set()
        self.written: list[int] = []
        """Sample ids the sink ended, in order."""

    @property
    def head(self) -> int | None:
        """The sample the sink takes next, or None when every sample is written or dropped."""
        return self._starts[self._head].sample_id if self._head < len(self._starts) else None

    def add(self, sample_id: int, rows: SampleRows, *, last: bool) -> None:
        """The sample's next rows (``last``: its final ones)."""
        if sample_id != self.head:
            self._held.setdefault(sample_id, []).append(rows)
            if last:
                self._complete.add(sample_id)
            return
        if not self._begun:
            self._sink.begin(self._starts[self._head])
            self._begun = True
        self._sink.add(rows)
        if last:
            self._end_head()
            self._advance()

    def drop(self, sample_id: int) -> None:
        """The sample is not written (failed or skipped): whatever it was given is dropped."""
        if sample_id != self.head:
            self._held.pop(sample_id, None)
            self._complete.discard(sample_id)
            self._dropped.add(sample_id)
            return
        if self._begun:
            self._sink.abandon()
            self._begun = False
        self._head += 1
        self._advance()

    def _end_head(self) -> None:
        self._sink.end()
        self.written.append(self._starts[self._head].sample_id)
        self._begun = False
        self._head += 1

    def _advance(self) -> None:
        """Write the held samples whose turn has come; stop at one still arriving."""
        while (sample_id := self.head) is not None:
            if sample_id in self._dropped:
                self._head += 1
                continue
            held = self._held.pop(sample_id, None)
            if held is None:
                return
            self._sink.begin(self._starts[self._head])
            self._begun = True
            for rows in held:
                self._sink.add(rows)
            if sample_id not in self._complete:
                return  # its other rows go straight to the sink as they arrive
            self._complete.discard(sample_id)
            self._end_head()
