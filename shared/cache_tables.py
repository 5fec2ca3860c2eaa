"""A cache's bookkeeping as numpy columns: one entry per sample, one per slot, no object per row.

Every reader (train, eval, inspect, validate) holds these instead of one Python object per sample
or slot, so a cache of 100M samples costs tens of bytes per sample to open, and a forked
DataLoader worker shares the columns with its parent instead of rebuilding them. Lookups are
index arithmetic: ``np.searchsorted`` on a sorted column, or offsets into a sorted permutation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Final, Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sparkforge.shared.errors import SparkforgeError

SPLITS: Final = ("train", "eval")
"""The split names; ``SampleColumns.split`` holds each sample's position in this tuple."""
SAMPLE_FIELDS: Final = ("sample_id", "unit", "slot", "row_offset", "length", "num_loss_tokens",
                        "split")
"""The index columns every reader loads; ``source_row`` and ``source_hash`` only on request."""
SOURCE_FIELDS: Final = ("source_row", "source_hash")
_DTYPES: Final = {"sample_id": np.int64, "unit": np.int32, "slot": np.int64,
                  "row_offset": np.int64, "length": np.int32, "num_loss_tokens": np.int32,
                  "split": np.uint8, "source_row": np.int64}

Ints = npt.NDArray[np.integer[Any]]


class TableError(SparkforgeError):
    """Raised when bookkeeping columns break an invariant the lookups rely on (order, codes)."""


@dataclass(frozen=True, eq=False)
class SampleColumns:
    """index.parquet as columns, sorted by ``sample_id`` (strictly increasing).

    ``storage_order`` lists the positions in storage order (unit, then row offset), None when
    that is sample-id order (as finalize writes it: then it costs nothing); with ``unit_starts``
    the samples of the k-th distinct unit ``units[k]`` are entries
    ``unit_starts[k]:unit_starts[k + 1]`` of that order.
    """

    sample_id: npt.NDArray[np.int64]
    unit: npt.NDArray[np.int32]
    slot: npt.NDArray[np.int64]
    row_offset: npt.NDArray[np.int64]
    """Absolute first row of the sample in every array."""
    length: npt.NDArray[np.int32]
    num_loss_tokens: npt.NDArray[np.int32]
    split: npt.NDArray[np.uint8]
    """Position of the sample's split in :data:`SPLITS`."""
    storage_order: Ints | None
    units: npt.NDArray[np.int32]
    """Distinct units, increasing."""
    unit_starts: Ints
    """``len(units) + 1`` offsets into ``storage_order``."""
    source_row: npt.NDArray[np.int64] | None = None
    source_hash: npt.NDArray[np.bytes_] | None = None
    """64-byte hex digests (only when loaded with ``sources``)."""

    def __len__(self) -> int:
        return int(self.sample_id.shape[0])

    @classmethod
    def from_columns(cls, columns: dict[str, np.ndarray]) -> SampleColumns:
        """Build from raw columns (``split`` as codes), already sorted by ``sample_id``.

        Raises:
            TableError: sample ids not strictly increasing, or a split code out of range.
        """
        ids = np.asarray(columns["sample_id"], dtype=np.int64)
        if ids.size > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise TableError("sample_id not unique and increasing")
        split = np.asarray(columns["split"], dtype=np.uint8)
        if split.size and int(split.max()) >= len(SPLITS):
            raise TableError(f"a split outside {list(SPLITS)}")
        unit = np.asarray(columns["unit"], dtype=np.int32)
        row_offset = np.asarray(columns["row_offset"], dtype=np.int64)
        order = storage_order(unit, row_offset)
        units, starts = group_starts(unit if order is None else unit[order])
        source_row = columns.get("source_row")
        source_hash = columns.get("source_hash")
        return cls(sample_id=ids, unit=unit, slot=np.asarray(columns["slot"], dtype=np.int64),
                   row_offset=row_offset,
                   length=np.asarray(columns["length"], dtype=np.int32),
                   num_loss_tokens=np.asarray(columns["num_loss_tokens"], dtype=np.int32),
                   split=split, storage_order=order, units=units, unit_starts=starts,
                   source_row=None if source_row is None else np.asarray(source_row, np.int64),
                   source_hash=None if source_hash is None else np.asarray(source_hash, "S64"))

    @classmethod
    def from_parquet(cls, source: BinaryIO | str, *, num_rows: int,
                     sources: bool = False) -> SampleColumns:
        """Read index.parquet row group by row group into preallocated columns (no Arrow table
        of the whole index and no ``source_hash`` strings unless ``sources``)."""
        names = [*SAMPLE_FIELDS, *(SOURCE_FIELDS if sources else ())]
        out: dict[str, np.ndarray] = {
            n: np.empty(num_rows, dtype="S64" if n == "source_hash" else _DTYPES[n])
            for n in names}
        at = 0
        for batch in pq.ParquetFile(source).iter_batches(batch_size=1 << 16, columns=names):
            n = batch.num_rows
            if at + n > num_rows:
                raise TableError(f"more rows than manifest storage.totals.samples {num_rows}")
            for name in names:
                column = batch.column(name)
                if name == "split":
                    column = pc.fill_null(pc.index_in(column, value_set=pa.array(SPLITS)), 255)
                if name == "source_hash":
                    fixed = column.cast(pa.binary(64))
                    out[name][at:at + n] = np.frombuffer(fixed.buffers()[1], dtype="S64",
                                                         count=n, offset=fixed.offset * 64)
                else:
                    out[name][at:at + n] = _integers(column, name)
            at += n
        if at != num_rows:
            raise TableError(f"{at} rows != manifest storage.totals.samples {num_rows}")
        return cls.from_columns(out)

    def positions(self, sample_ids: Sequence[int] | np.ndarray) -> Ints:
        """Positions of ``sample_ids``.

        Raises:
            KeyError: naming the first id the index does not hold.
        """
        ids = np.asarray(sample_ids, dtype=np.int64)
        at = np.searchsorted(self.sample_id, ids)
        found = at < self.sample_id.size
        found[found] = self.sample_id[at[found]] == ids[found]
        if not bool(found.all()):
            raise KeyError(f"sample {int(ids[np.argmin(found)])} is not in the index")
        return at

    def of_unit(self, unit: int) -> Ints:
        """Positions of a unit's samples in storage order (empty for a unit with none)."""
        k = int(np.searchsorted(self.units, unit))
        if k == self.units.size or int(self.units[k]) != unit:
            return np.zeros(0, dtype=np.int64)
        return self.in_storage_order(slice(int(self.unit_starts[k]), int(self.unit_starts[k + 1])))

    def in_storage_order(self, entries: slice | npt.NDArray[np.bool_] = slice(None)) -> Ints:
        """Positions of ``entries`` of the storage order (a slice of it, or a mask over the
        samples, kept in storage order)."""
        if isinstance(entries, slice):
            if self.storage_order is not None:
                return self.storage_order[entries]
            return np.arange(*entries.indices(len(self)), dtype=np.int64)
        if self.storage_order is None:
            return np.flatnonzero(entries)
        return self.storage_order[entries[self.storage_order]]

    def in_split(self, split: str) -> npt.NDArray[np.bool_]:
        """Mask of the samples of ``split``."""
        mask: npt.NDArray[np.bool_] = self.split == SPLITS.index(split)
        return mask

    def split_counts(self) -> dict[str, int]:
        """Samples per split (splits with none left out)."""
        counts = np.bincount(self.split, minlength=len(SPLITS))
        return {name: int(n) for name, n in zip(SPLITS, counts, strict=True) if n}


class _UnitSlots(Protocol):
    @property
    def unit(self) -> int: ...

    @property
    def slots(self) -> Sequence[Any]: ...


@dataclass(frozen=True, eq=False)
class SlotColumns:
    """One row per committed slot, sorted by (unit, slot): used rows and crc32c per array.

    ``crc32c[i, j]`` is the checksum of array ``arrays[j]`` over slot ``i``'s used rows.
    """

    unit: npt.NDArray[np.int32]
    slot: npt.NDArray[np.int64]
    num_rows: npt.NDArray[np.int64]
    crc32c: npt.NDArray[np.uint32]
    arrays: tuple[str, ...]

    def __len__(self) -> int:
        return int(self.slot.shape[0])

    @classmethod
    def from_units(cls, units: Iterable[_UnitSlots], arrays: Sequence[str]) -> SlotColumns:
        """From unit entries holding ``SlotRecord``s (today's manifest ``storage.units``).

        Raises:
            TableError: a slot lacks the crc32c of one of ``arrays``.
        """
        unit, slot, rows, crc = [], [], [], []
        for entry in units:
            for s in entry.slots:
                missing = [a for a in arrays if a not in s.crc32c]
                if missing:
                    raise TableError(f"unit {entry.unit}, slot {s.slot}: no crc32c for "
                                     f"{missing}")
                unit.append(entry.unit)
                slot.append(s.slot)
                rows.append(s.num_rows)
                crc.append([s.crc32c[a] for a in arrays])
        return cls.from_columns(unit=unit, slot=slot, num_rows=rows,
                                crc32c=np.asarray(crc, np.uint32).reshape(-1, len(arrays)),
                                arrays=arrays)

    @classmethod
    def from_columns(cls, *, unit: Sequence[int] | np.ndarray, slot: Sequence[int] | np.ndarray,
                     num_rows: Sequence[int] | np.ndarray, crc32c: np.ndarray,
                     arrays: Sequence[str]) -> SlotColumns:
        """Build from columns in any order; rows are sorted by (unit, slot)."""
        u = np.asarray(unit, dtype=np.int32)
        s = np.asarray(slot, dtype=np.int64)
        order = np.lexsort((s, u))
        return cls(unit=u[order], slot=s[order],
                   num_rows=np.asarray(num_rows, dtype=np.int64)[order],
                   crc32c=np.asarray(crc32c, dtype=np.uint32)[order], arrays=tuple(arrays))

    def of_unit(self, unit: int) -> slice:
        """The rows of ``unit``'s slots (an empty slice for a unit with none)."""
        return slice(int(np.searchsorted(self.unit, unit, "left")),
                     int(np.searchsorted(self.unit, unit, "right")))

    def row_of(self, unit: int, slot: int) -> int:
        """The row of one slot of ``unit``.

        Raises:
            KeyError: the unit has no such slot.
        """
        rows = self.of_unit(unit)
        k: int = rows.start + int(np.searchsorted(self.slot[rows], slot))
        if k == rows.stop or int(self.slot[k]) != slot:
            raise KeyError(f"unit {unit} has no slot {slot}")
        return k

    def checksums(self, row: int) -> dict[str, int]:
        """Array name -> crc32c of one slot (a dict for one slot, e.g. for an error message)."""
        return dict(zip(self.arrays, self.crc32c[row].tolist(), strict=True))


def storage_order(unit: np.ndarray, row_offset: np.ndarray) -> Ints | None:
    """Positions sorted by (unit, row offset); None when they already are in that order."""
    ordered = unit.size < 2 or bool(
        ((unit[1:] > unit[:-1]) | ((unit[1:] == unit[:-1]) & (row_offset[1:] > row_offset[:-1])))
        .all())
    if ordered:
        return None
    order: Ints = np.lexsort((row_offset, unit))
    return order


def group_starts(sorted_keys: np.ndarray) -> tuple[np.ndarray, Ints]:
    """Distinct keys of a sorted array and the ``len + 1`` offsets where each run starts."""
    if not sorted_keys.size:
        return sorted_keys[:0], np.zeros(1, dtype=np.int64)
    first = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    return sorted_keys[first], np.r_[first, sorted_keys.size].astype(np.int64)


def _integers(column: Any, name: str) -> np.ndarray:
    """An integer Arrow array as a numpy view of its buffer (``to_numpy`` imports pandas, which
    costs seconds and tens of MB).

    Raises:
        TableError: the column holds nulls.
    """
    if column.null_count:
        raise TableError(f"{name}: {column.null_count} null values")
    return np.frombuffer(column.buffers()[1], dtype=f"<i{column.type.bit_width // 8}",
                         count=len(column), offset=column.offset)
