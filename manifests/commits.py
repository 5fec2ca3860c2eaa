"""Read every unit's commit record, many at once, and fold them into the cache's columns.

Finalize and validate read one record per unit: :func:`read_commits` keeps ``max_concurrency``
reads in flight (an object store answers each in tens of milliseconds) and parses them in unit
order; :class:`CommitCollector` keeps each record's unit and slot rows as columns (a few bytes
per sample), and no sample outlives its record.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from sparkforge.manifests.objects import MAX_COMMIT_BYTES
from sparkforge.manifests.scan import SlotToScan
from sparkforge.manifests.units import UnitColumns
from sparkforge.shared import storage
from sparkforge.shared.cache_tables import SlotColumns
from sparkforge.shared.commit_columns import CommitColumns, parse_commit_columns
from sparkforge.shared.layout import CacheSpec, commit_key


def read_commits(loc: storage.Location, spec: CacheSpec, units: Iterable[int], *,
                 max_concurrency: int = storage.DEFAULT_MAX_CONCURRENCY,
                 ) -> Iterator[tuple[int, CommitColumns | OSError | ValueError]]:
    """Each unit's parsed commit record, in the order of ``units``, or the error that reading
    or parsing it raised (``FileNotFoundError`` for a missing record)."""
    keys = (commit_key(spec, u) for u in units)
    for key, raw in storage.read_many(loc, keys, max_bytes=MAX_COMMIT_BYTES,
                                      max_concurrency=max_concurrency):
        unit = int(key.rsplit("_", 1)[1].split(".")[0])
        if isinstance(raw, bytes):
            try:
                yield unit, parse_commit_columns(raw, unit=unit, spec=spec)
            except ValueError as exc:
                yield unit, exc
        else:
            yield unit, raw


class CommitCollector:
    """Commit records folded into columns: one row per unit and per slot (their samples are
    streamed on: :class:`~sparkforge.manifests.index_rows.IndexBatches`)."""

    def __init__(self, arrays: tuple[str, ...]) -> None:
        self.arrays = arrays
        self._units: list[tuple[int, int, int, int, Any]] = []
        self._slots: list[tuple[int, npt.NDArray[np.int64], npt.NDArray[np.int64],
                                npt.NDArray[np.uint32]]] = []

    def add(self, c: CommitColumns) -> None:
        """Keep one unit's unit and slot rows."""
        self._units.append((c.unit, c.attempt, c.num_samples, c.num_tokens, c.accounting))
        self._slots.append((c.unit, c.slot, c.num_rows, c.crc32c))

    def units(self) -> UnitColumns:
        """One row per unit added."""
        return UnitColumns.from_rows(self._units)

    def slots(self) -> SlotColumns:
        """One row per slot of the units added."""
        if not self._slots:
            return SlotColumns.from_columns(unit=[], slot=[], num_rows=[], arrays=self.arrays,
                                            crc32c=np.zeros((0, len(self.arrays)), np.uint32))
        return SlotColumns.from_columns(
            unit=np.concatenate([np.full(s.size, u) for u, s, _, _ in self._slots]),
            slot=np.concatenate([s for _, s, _, _ in self._slots]),
            num_rows=np.concatenate([n for _, _, n, _ in self._slots]),
            crc32c=np.concatenate([c for _, _, _, c in self._slots]), arrays=self.arrays)

    @property
    def num_tokens(self) -> int:
        """Rows the units added store."""
        return sum(int(n.sum()) for _, _, n, _ in self._slots)


def slots_to_scan(c: CommitColumns, shard_rows: int) -> Iterator[SlotToScan]:
    """Each slot of one unit's record with the samples holding rows of it (a sample spanning
    slots in each of them) in storage order."""
    s = c.samples
    # Rows are absolute and no two samples share one, so row order is storage order and the
    # ends increase with it.
    order = np.argsort(s["row_offset"], kind="stable")
    starts = s["row_offset"][order]
    ends = starts + s["length"][order]
    for k, slot in enumerate(c.slot.tolist()):
        take = order[np.searchsorted(ends, slot * shard_rows, "right"):
                     np.searchsorted(starts, (slot + 1) * shard_rows)]
        yield SlotToScan(unit=c.unit, slot=slot, num_rows=int(c.num_rows[k]),
                         crc32c=dict(zip(c.arrays, c.crc32c[k].tolist(), strict=True)),
                         sample_id=s["sample_id"][take], row_offset=s["row_offset"][take],
                         length=s["length"][take], num_loss_tokens=s["num_loss_tokens"][take])
