"""InOrder: a unit's samples reach the writer in sample-id order, chunk by chunk, whatever the
order their results come in; a dropped sample leaves nothing."""

from __future__ import annotations

import numpy as np

from sparkforge.producer.sample_order import InOrder
from sparkforge.shared.records import SampleRows, SampleStart


class Log:
    """A sink that records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def begin(self, start: SampleStart) -> None:
        self.calls.append(("begin", start.sample_id))

    def add(self, rows: SampleRows) -> None:
        self.calls.append(("add", int(rows.final_hidden[0, 0])))

    def end(self) -> None:
        self.calls.append(("end", -1))

    def abandon(self) -> None:
        self.calls.append(("abandon", -1))


def _start(sample_id: int) -> SampleStart:
    ids = np.zeros(4, np.int32)
    return SampleStart(sample_id=sample_id, source_row=sample_id, source_hash="ab", split="train",
                       input_ids=ids, loss_mask=ids.astype(np.uint8))


def _rows(tag: int) -> SampleRows:
    return SampleRows(aux_hidden=np.zeros((1, 1, 1)), final_hidden=np.full((1, 1), tag))


def test_results_out_of_order_reach_the_sink_in_sample_order() -> None:
    """Sample 2 finishes first and waits; sample 0 streams in two chunks straight through; then
    sample 1's held chunk goes to the sink (its turn came) and its drop abandons it; sample 2
    follows from the hold, and sample 3, arriving after its turn came, goes straight through."""
    log = Log()
    order = InOrder(log, [_start(i) for i in range(4)])
    order.add(2, _rows(20), last=True)
    order.add(1, _rows(10), last=False)
    assert log.calls == []
    order.add(0, _rows(0), last=False)
    assert log.calls == [("begin", 0), ("add", 0)]
    order.add(0, _rows(1), last=True)
    order.drop(1)
    assert order.head == 3
    order.add(3, _rows(30), last=True)
    assert order.head is None
    assert log.calls == [("begin", 0), ("add", 0), ("add", 1), ("end", -1),
                         ("begin", 1), ("add", 10), ("abandon", -1),
                         ("begin", 2), ("add", 20), ("end", -1),
                         ("begin", 3), ("add", 30), ("end", -1)]
    assert order.written == [0, 2, 3]


def test_dropping_the_sample_being_streamed_abandons_it_and_writes_the_next() -> None:
    """A head sample dropped after some of its chunks (a NaN chunk, a failure) is abandoned in
    the sink, and a held sample whose turn comes is begun and keeps streaming as it arrives."""
    log = Log()
    order = InOrder(log, [_start(i) for i in range(2)])
    order.add(0, _rows(0), last=False)
    order.add(1, _rows(10), last=False)
    order.drop(0)
    order.add(1, _rows(11), last=True)
    assert log.calls == [("begin", 0), ("add", 0), ("abandon", -1),
                         ("begin", 1), ("add", 10), ("add", 11), ("end", -1)]
    assert order.written == [1]
