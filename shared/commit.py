"""Commit records: what one committed unit holds (slots, checksums, sample rows, accounting)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import numpy.typing as npt

from sparkforge.shared.layout import FORMAT_VERSION
from sparkforge.shared.records import Split, UnitAccounting

SAMPLE_COLUMNS = ("sample_id", "slot", "row_offset", "length", "num_loss_tokens", "source_row",
                  "source_hash", "split")


def checksum(values: npt.NDArray[Any]) -> int:
    """crc32c of an array's C-order little-endian bytes (the decoded rows a slot holds)."""
    # A byte view, not tobytes(): no copy of a slot that may hold hundreds of MB.
    return int(crc32c.crc32c(np.ascontiguousarray(values).data.cast("B")))


@dataclass(frozen=True, kw_only=True)
class SlotRecord:
    """One slot of a unit: its id, used rows and the crc32c of each array over those rows."""

    slot: int
    num_rows: int
    crc32c: dict[str, int]


@dataclass(frozen=True, kw_only=True)
class SampleRow:
    """Where one sample lives: ``row_offset`` is the absolute first row in every array."""

    sample_id: int
    slot: int
    row_offset: int
    length: int
    num_loss_tokens: int
    source_row: int
    source_hash: str
    split: Split


@dataclass(frozen=True, kw_only=True)
class UnitInfo:
    """A committed unit: the attempt that won, its slots, its samples and its accounting."""

    unit: int
    attempt: int
    slots: tuple[SlotRecord, ...]
    samples: tuple[SampleRow, ...]
    accounting: UnitAccounting

    @property
    def sample_ids(self) -> list[int]:
        """Sample ids in storage order."""
        return [s.sample_id for s in self.samples]

    @property
    def splits(self) -> list[str]:
        """Split of each sample, aligned with :attr:`sample_ids`."""
        return [s.split for s in self.samples]

    @property
    def num_tokens(self) -> int:
        """Tokens stored by this unit."""
        return sum(s.length for s in self.samples)

    def to_json(self) -> dict[str, Any]:
        """The commit record as JSON (sample rows stored column-wise to stay compact)."""
        acc = self.accounting
        return {
            "format_version": FORMAT_VERSION,
            "unit": self.unit,
            "attempt": self.attempt,
            "slots": [{"slot": s.slot, "num_rows": s.num_rows, "crc32c": dict(s.crc32c)}
                      for s in self.slots],
            "samples": {c: [getattr(s, c) for s in self.samples] for c in SAMPLE_COLUMNS},
            "accounting": {"input_rows": acc.input_rows, "written": acc.written,
                           "skipped": dict(acc.skipped), "failed": acc.failed},
        }

    def to_bytes(self) -> bytes:
        """Serialised commit record."""
        return json.dumps(self.to_json(), sort_keys=True).encode()
