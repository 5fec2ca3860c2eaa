"""Counters of one producer run, its progress-bar line and its final summary table."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sparkforge.producer.units import WorkerShare
from sparkforge.shared.header import MixInfo
from sparkforge.shared.records import SampleRecord, UnitAccounting


def format_table(rows: Sequence[tuple[str, str]]) -> str:
    """Two aligned plain-text columns."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def nbytes(*arrays: np.ndarray | None) -> int:
    """Bytes of the arrays given (None: none)."""
    return sum(a.nbytes for a in arrays if a is not None)


@dataclass
class UnitTally:
    """What a committed unit's samples hold, counted as they went to the writer."""

    sample_ids: list[int] = field(default_factory=list)
    tokens: int = 0
    loss_tokens: int = 0
    bytes_raw: int = 0

    @classmethod
    def of(cls, records: Sequence[SampleRecord]) -> UnitTally:
        """The tally of whole records."""
        return cls([r.sample_id for r in records], sum(r.num_tokens for r in records),
                   sum(int(r.loss_mask.sum()) for r in records),
                   sum(nbytes(r.input_ids, r.loss_mask, r.aux_hidden, r.aux_scale,
                              r.final_hidden, r.topk_ids, r.topk_logprobs) for r in records))


@dataclass
class RunSummary:
    """What one worker did in this run (units committed earlier are not counted)."""

    output: str
    worker: WorkerShare
    units_owned: int
    units_todo: int
    num_rows: int
    """Input rows of the whole dataset."""
    units_done: int = 0
    units_taken_over: int = 0
    """Units another process committed while this one ran (skipped, not redone)."""
    input_rows: int = 0
    written: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    failed: int = 0
    image_rows: int = 0
    """Written samples that are image rows."""
    tokens: int = 0
    loss_tokens: int = 0
    bytes_raw: int = 0
    """Uncompressed bytes handed to the writer."""
    seconds: float = 0.0
    finalized: bool = False
    mix: tuple[MixInfo, ...] | None = None
    """The weighted mix the rows are drawn from, if any."""
    mix_written: Counter[str] = field(default_factory=Counter)
    """Samples written by this run per mix entry."""

    def add_unit(self, tally: UnitTally, accounting: UnitAccounting) -> None:
        """Count one committed unit."""
        self.units_done += 1
        self.input_rows += accounting.input_rows
        self.written += accounting.written
        self.skipped.update(accounting.skipped)
        self.failed += accounting.failed
        self.image_rows += accounting.image_rows or 0
        self.tokens += tally.tokens
        self.loss_tokens += tally.loss_tokens
        self.bytes_raw += tally.bytes_raw
        if self.mix:
            starts = [e.first_sample for e in self.mix]
            self.mix_written.update(self.mix[bisect.bisect_right(starts, i) - 1].name
                                    for i in tally.sample_ids)

    def accounting(self) -> UnitAccounting:
        """This run's rows: written (image rows among them), skipped by reason, failed."""
        return UnitAccounting(input_rows=self.input_rows, written=self.written,
                              skipped=dict(self.skipped), failed=self.failed,
                              image_rows=self.image_rows)

    def progress(self, elapsed_s: float) -> str:
        """The progress bar's postfix: samples, tokens/s, bytes written."""
        rate = self.tokens / elapsed_s if elapsed_s > 0 else 0.0
        return (f"samples={self.written} skipped={sum(self.skipped.values())} "
                f"failed={self.failed} tok/s={rate:,.0f} written={self.bytes_raw / 2**20:,.1f}MiB")

    def table(self) -> str:
        """A plain-text summary table for the end of the run."""
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        rows = [
            ("cache", self.output),
            ("worker", f"{self.worker.worker_index} of {self.worker.num_workers} "
                       f"({self.worker.origin})"),
            ("units", f"{self.units_done} committed now, {self.units_owned - self.units_todo} "
                      f"already committed, {self.units_owned} owned"),
            *([("units taken over", f"{self.units_taken_over} committed by another process "
                                    "meanwhile (skipped)")] if self.units_taken_over else []),
            ("input rows", f"{self.input_rows:,}"),
            ("written", f"{self.written:,}"
                        + (f" ({self.image_rows:,} image rows)" if self.image_rows else "")),
            *((f"skipped: {k}", f"{v:,}") for k, v in sorted(self.skipped.items())),
            ("failed", f"{self.failed:,}"),
            *((f"mix: {e.name}", f"weight {e.weight:g}, {e.rows:,} rows drawn of "
                                 f"{e.source_rows:,} held, {self.mix_written[e.name]:,} written "
                                 "now") for e in self.mix or ()),
            ("tokens", f"{self.tokens:,} ({self.loss_tokens:,} with loss)"),
            ("throughput", f"{rate:,.0f} tokens/s over {self.seconds:,.1f} s"),
            ("bytes (raw)", f"{self.bytes_raw / 2**20:,.1f} MiB"),
            ("manifest", "finalized" if self.finalized else "not yet (other units missing)"),
        ]
        return format_table(rows)
