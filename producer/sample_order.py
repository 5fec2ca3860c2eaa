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

import numpy as np

from sparkforge.shared.records import SampleRecord, SampleRows, SampleStart


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


class RecordCollector:
    """A sink that keeps each sample whole, as a ``SampleRecord`` (for callers that want the
    records themselves, not a cache)."""

    def __init__(self) -> None:
        self.records: list[SampleRecord] = []
        self._start: SampleStart | None = None
        self._rows: list[SampleRows] = []

    def begin(self, start: SampleStart) -> None:
        """Start a sample."""
        self._start, self._rows = start, []

    def add(self, rows: SampleRows) -> None:
        """Keep the sample's next rows."""
        self._rows.append(rows)

    def end(self) -> None:
        """Join the sample's rows into its record."""
        assert self._start is not None
        s, rows = self._start, self._rows

        def joined(name: str) -> np.ndarray | None:
            values: list[np.ndarray | None] = [getattr(r, name) for r in rows]
            if values[0] is None:
                return None
            return values[0] if len(values) == 1 else np.concatenate(
                [v for v in values if v is not None])

        aux, final = joined("aux_hidden"), joined("final_hidden")
        assert aux is not None
        assert final is not None
        self.records.append(SampleRecord(
            sample_id=s.sample_id, source_row=s.source_row, source_hash=s.source_hash,
            split=s.split, input_ids=s.input_ids, loss_mask=s.loss_mask, aux_hidden=aux,
            final_hidden=final, aux_scale=joined("aux_scale"), topk_ids=joined("topk_ids"),
            topk_logprobs=joined("topk_logprobs")))
        self._start, self._rows = None, []

    def abandon(self) -> None:
        """Forget the started sample."""
        self._start, self._rows = None, []
