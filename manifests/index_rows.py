"""The index rows commit records imply, as Arrow batches: streamed in unit order, or all sorted.

A cache's sample ids rise with its units (each unit holds a contiguous range of source rows), so
the index finalize writes, sorted by sample id, is its units' rows one after the other:
:class:`IndexBatches` cuts that stream into batches of :data:`BATCH_ROWS` rows and never holds
more (finalize writes each as a row group; validate compares each with the stored index). When a
unit's ids are not all above the previous unit's, the stream stops (``in_order`` False) and the
caller reads the records again into :class:`SortedRows`, which holds every row to sort them.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from sparkforge.manifests.index import INDEX_SCHEMA
from sparkforge.shared.cache_tables import SPLITS
from sparkforge.shared.commit_columns import CommitColumns
from sparkforge.shared.fields import ManifestError

BATCH_ROWS: Final = 1 << 17
"""Rows per batch (and per row group of index.parquet): ~20 MB of Arrow columns."""
_SPLIT_NAMES: Final = pa.array(SPLITS, pa.string())


class IndexBatches:
    """Commit records, in unit order, turned into index batches of :data:`BATCH_ROWS` rows."""

    def __init__(self) -> None:
        self.in_order = True
        """False once a unit's sample ids did not all exceed the earlier units' (the stream
        stops there: read the records again into :class:`SortedRows`)."""
        self._parts: list[dict[str, Any]] = []
        self._rows = 0
        self._last_id = -(1 << 63)

    def add(self, c: CommitColumns) -> pa.RecordBatch | None:
        """Take one unit's rows; returns a batch once :data:`BATCH_ROWS` rows are held."""
        if not self.in_order or not c.num_samples:
            return None
        part = _unit_columns(c, sort=True)
        ids = part["sample_id"]
        if int(ids[0]) <= self._last_id:
            self.in_order = False
            self._parts, self._rows = [], 0
            return None
        self._last_id = int(ids[-1])
        self._parts.append(part)
        self._rows += ids.size
        return self._take() if self._rows >= BATCH_ROWS else None

    def rest(self) -> pa.RecordBatch | None:
        """The rows not yet returned (None when none are, or once out of order)."""
        return self._take() if self._rows else None

    def _take(self) -> pa.RecordBatch:
        batch = _batch(self._parts)
        self._parts, self._rows = [], 0
        return batch


class SortedRows:
    """Every unit's rows held until :meth:`table` sorts them (for ids not rising with units)."""

    def __init__(self) -> None:
        self._parts: list[dict[str, Any]] = []

    def add(self, c: CommitColumns) -> None:
        """Keep one unit's rows."""
        self._parts.append(_unit_columns(c, sort=False))

    def table(self) -> pa.Table:
        """The index of every row added, sorted by sample id.

        Raises:
            ManifestError: a sample id appears in more than one unit (naming a few and their
                units).
        """
        if not self._parts:
            return INDEX_SCHEMA.empty_table()
        batch = _batch(self._parts)
        ids = batch.column("sample_id").to_numpy()
        order = np.argsort(ids, kind="stable")
        _check_unique(ids[order], batch.column("unit").to_numpy()[order])
        return pa.Table.from_batches([batch.take(pa.array(order))])


def _unit_columns(c: CommitColumns, *, sort: bool) -> dict[str, Any]:
    """One unit's index columns (sorted by sample id when ``sort``)."""
    s = c.samples
    order = np.argsort(s["sample_id"], kind="stable") if sort else None
    out: dict[str, Any] = {}
    for name in INDEX_SCHEMA.names:
        if name == "unit":
            out[name] = np.full(c.num_samples, c.unit, dtype=np.int64)
        elif name == "source_hash":
            hashes = s[name]
            out[name] = hashes if order is None else [hashes[i] for i in order.tolist()]
        else:
            out[name] = s[name] if order is None else s[name][order]
    return out


def _batch(parts: list[dict[str, Any]]) -> pa.RecordBatch:
    """The parts' rows, one after the other, as one batch of :data:`INDEX_SCHEMA`."""
    columns = []
    for field in INDEX_SCHEMA:
        if field.name == "source_hash":
            columns.append(pa.array([h for p in parts for h in p[field.name]], pa.string()))
        elif field.name == "split":
            codes = np.concatenate([p["split"] for p in parts])
            columns.append(pc.take(_SPLIT_NAMES, pa.array(codes)))
        else:
            columns.append(pa.array(np.concatenate([p[field.name] for p in parts]), field.type))
    return pa.RecordBatch.from_arrays(columns, schema=INDEX_SCHEMA)


def _check_unique(ids: npt.NDArray[np.int64], units: npt.NDArray[np.int64]) -> None:
    """Sorted sample ids must not repeat; the error names up to five and their units."""
    repeated = np.flatnonzero(ids[1:] == ids[:-1])
    if not repeated.size:
        return
    dups = np.unique(ids[repeated])
    where = {int(sid): sorted(set(units[ids == sid].tolist())) for sid in dups[:5]}
    raise ManifestError(f"{dups.size} sample ids appear in more than one unit, e.g. "
                        + "; ".join(f"sample {k} in units {v}" for k, v in where.items()))
