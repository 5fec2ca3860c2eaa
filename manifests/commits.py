"""Read every unit's commit record, many at once, and fold them into the cache's columns.

Finalize and validate read one record per unit: :func:`read_commits` keeps ``max_concurrency``
reads in flight (an object store answers each in tens of milliseconds) and parses them in unit
order; :class:`CommitCollector` keeps what each record holds as columns, so memory stays a few
dozen bytes per sample and no object per sample outlives its record.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from sparkforge.manifests.index import INDEX_SCHEMA
from sparkforge.manifests.objects import MAX_COMMIT_BYTES
from sparkforge.manifests.scan import SlotToScan
from sparkforge.manifests.units import UnitColumns
from sparkforge.shared import storage
from sparkforge.shared.cache_tables import SPLITS, SlotColumns
from sparkforge.shared.commit_columns import CommitColumns, parse_commit_columns
from sparkforge.shared.fields import ManifestError
from sparkforge.shared.layout import CacheSpec, commit_key


def read_commits(loc: storage.Location, spec: CacheSpec, units: Iterable[int], *,
                 max_concurrency: int = storage.DEFAULT_MAX_CONCURRENCY,
                 ) -> Iterator[tuple[int, CommitColumns | OSError | ValueError]]:
    """Each unit's parsed commit record, in the order of ``units``, or the error that reading
    or parsing it raised (``FileNotFoundError`` for a missing record)."""
    keys = (commit_key(u) for u in units)
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
    """Commit records folded into columns: per sample (the index), per slot, per unit."""

    def __init__(self, arrays: tuple[str, ...]) -> None:
        self.arrays = arrays
        self._units: list[tuple[int, int, int, int, Any]] = []
        self._slots: list[tuple[int, npt.NDArray[np.int64], npt.NDArray[np.int64],
                                npt.NDArray[np.uint32]]] = []
        self._samples: dict[str, list[Any]] = {name: [] for name in INDEX_SCHEMA.names}

    def add(self, c: CommitColumns) -> None:
        """Keep one unit's record (its per-sample columns as arrays; the record can go)."""
        self._units.append((c.unit, c.attempt, c.num_samples, c.num_tokens, c.accounting))
        self._slots.append((c.unit, c.slot, c.num_rows, c.crc32c))
        for name in INDEX_SCHEMA.names:
            if name == "unit":
                self._samples[name].append(np.full(c.num_samples, c.unit, dtype=np.int64))
            elif name == "source_hash":
                self._samples[name].append(pa.array(c.samples[name], pa.string()))
            else:
                self._samples[name].append(c.samples[name])

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

    def slots_to_scan(self, shard_rows: int) -> Iterator[SlotToScan]:
        """Each slot of the units added with the samples holding rows of it (a sample spanning
        slots in each of them) in storage order, unit by unit."""
        cols = {name: np.concatenate(self._samples[name]) if self._samples[name] else
                np.zeros(0, np.int64)
                for name in ("sample_id", "row_offset", "length", "num_loss_tokens")}
        # Rows are absolute and no two samples share one, so row order is storage order and
        # the ends increase with it.
        order = np.argsort(cols["row_offset"], kind="stable")
        starts = cols["row_offset"][order]
        ends = starts + cols["length"][order]
        for unit, ids, rows, crcs in self._slots:
            for k, slot in enumerate(ids.tolist()):
                take = order[np.searchsorted(ends, slot * shard_rows, "right"):
                             np.searchsorted(starts, (slot + 1) * shard_rows)]
                yield SlotToScan(unit=unit, slot=slot, num_rows=int(rows[k]),
                                 crc32c=dict(zip(self.arrays, crcs[k].tolist(), strict=True)),
                                 sample_id=cols["sample_id"][take],
                                 row_offset=cols["row_offset"][take],
                                 length=cols["length"][take],
                                 num_loss_tokens=cols["num_loss_tokens"][take])

    def index(self) -> pa.Table:
        """The index of every sample added, sorted by sample id.

        Raises:
            ManifestError: a sample id appears in more than one unit (naming a few and their
                units).
        """
        columns: dict[str, Any] = {}
        for name, parts in self._samples.items():
            if name == "source_hash":
                columns[name] = pa.chunked_array(parts, pa.string()).combine_chunks()
            else:
                columns[name] = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        ids = columns["sample_id"]
        order = np.argsort(ids, kind="stable")
        _check_unique(ids[order], columns["unit"][order])
        splits = pc.take(pa.array(SPLITS, pa.string()), pa.array(columns["split"][order]))
        return pa.table({name: splits if name == "split" else
                          pc.take(columns[name], pa.array(order)) if name == "source_hash" else
                          pa.array(columns[name][order], INDEX_SCHEMA.field(name).type)
                          for name in INDEX_SCHEMA.names}, schema=INDEX_SCHEMA)


def _check_unique(ids: npt.NDArray[np.int64], units: npt.NDArray[np.int64]) -> None:
    """Sorted sample ids must not repeat; the error names up to five and their units."""
    repeated = np.flatnonzero(ids[1:] == ids[:-1])
    if not repeated.size:
        return
    dups = np.unique(ids[repeated])
    where = {int(sid): sorted(set(units[ids == sid].tolist())) for sid in dups[:5]}
    raise ManifestError(f"{dups.size} sample ids appear in more than one unit, e.g. "
                        + "; ".join(f"sample {k} in units {v}" for k, v in where.items()))
