"""Parse a commit record into columns: each sample field checked as one numpy array.

Finalize, validate and status read one record per unit; checking the fields column by column
instead of building and checking one object per sample keeps that near a microsecond per sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from sparkforge.shared import fields as f
from sparkforge.shared.cache_tables import SPLITS
from sparkforge.shared.commit import (
    SAMPLE_COLUMNS,
    SampleRow,
    SlotRecord,
    UnitInfo,
    parse_accounting,
    parse_slots,
)
from sparkforge.shared.fields import ManifestError
from sparkforge.shared.layout import CacheSpec, array_layouts, sample_slots
from sparkforge.shared.records import UnitAccounting


@dataclass(frozen=True, eq=False)
class CommitColumns:
    """A parsed commit record as columns: one numpy array per sample field, none per sample.

    ``samples`` maps each of :data:`SAMPLE_COLUMNS` to an int64 array, except ``source_hash``
    (a list of hex strings) and ``split`` (uint8 positions in :data:`SPLITS`);
    ``crc32c[i, j]`` is array ``arrays[j]``'s checksum over slot ``slot[i]``.
    """

    unit: int
    attempt: int
    accounting: UnitAccounting
    slot: npt.NDArray[np.int64]
    num_rows: npt.NDArray[np.int64]
    crc32c: npt.NDArray[np.uint32]
    arrays: tuple[str, ...]
    samples: dict[str, Any]

    @property
    def num_samples(self) -> int:
        """Samples the unit stores."""
        return int(self.samples["sample_id"].size)

    @property
    def num_tokens(self) -> int:
        """Tokens the unit stores."""
        return int(self.num_rows.sum())

    def slot_records(self) -> tuple[SlotRecord, ...]:
        """The slots as :class:`SlotRecord` objects (a handful per unit)."""
        return tuple(SlotRecord(slot=int(s), num_rows=int(n),
                                crc32c=dict(zip(self.arrays, c.tolist(), strict=True)))
                     for s, n, c in zip(self.slot, self.num_rows, self.crc32c, strict=True))

    def to_info(self) -> UnitInfo:
        """The record as a :class:`UnitInfo` (one :class:`SampleRow` per sample)."""
        cols = self.samples
        rows = tuple(SampleRow(sample_id=i, slot=s, row_offset=o, length=n, num_loss_tokens=k,
                               source_row=r, source_hash=h, split=SPLITS[c])
                     for i, s, o, n, k, r, h, c in zip(
                         *(cols[name].tolist() for name in _INT_COLUMNS), cols["source_hash"],
                         cols["split"].tolist(), strict=True))
        return UnitInfo(unit=self.unit, attempt=self.attempt, slots=self.slot_records(),
                        samples=rows, accounting=self.accounting)


def parse_commit_bytes(raw: bytes, *, unit: int, spec: CacheSpec) -> UnitInfo:
    """Decode and parse the commit record stored for ``unit``."""
    return parse_commit_columns(raw, unit=unit, spec=spec).to_info()


def parse_commit_columns(raw: bytes, *, unit: int, spec: CacheSpec) -> CommitColumns:
    """Decode and parse the commit record stored for ``unit`` into columns.

    Raises:
        ManifestError: ``commit record of unit U: ...`` naming the field, e.g.
            ``samples.row_offset[3]``.
    """
    data = f.load_json(raw, f"commit record of unit {unit}")
    try:
        return _parse_columns(data, unit=unit, spec=spec)
    except ManifestError as exc:
        raise ManifestError(f"commit record of unit {unit}: {exc}") from exc


def _parse_columns(data: object, *, unit: int, spec: CacheSpec) -> CommitColumns:
    """A commit record whose slots, rows and accounting are consistent with ``unit``."""
    d = f.obj(data, "commit", required=frozenset({"format_version", "unit", "attempt", "slots",
                                                  "samples", "accounting"}))
    f.choice(d["format_version"], "format_version", (spec.format_version,))
    if f.integer(d["unit"], "unit") != unit:
        raise f.fail("unit", f"{unit} (the unit named by the record's key)", d["unit"])
    attempt = f.integer(d["attempt"], "attempt", hi=999)
    slots = parse_slots(d["slots"], "slots", spec=spec, unit=unit, attempt=attempt)
    arrays = tuple(array_layouts(spec))
    accounting = parse_accounting(d["accounting"])
    cols = f.obj(d["samples"], "samples", required=frozenset(SAMPLE_COLUMNS))
    n = accounting.written
    for name in SAMPLE_COLUMNS:
        if len(f.array(cols[name], f"samples.{name}", max_len=spec.rows_per_unit)) != n:
            raise f.fail(f"samples.{name}", f"{n} entries (accounting.written)", len(cols[name]))
    lo = unit * spec.rows_per_unit
    length = _int_column(cols, "length", lo=1, hi=spec.max_seq_len)
    samples: dict[str, Any] = {
        "sample_id": _int_column(cols, "sample_id"),
        "slot": _int_column(cols, "slot"),
        "row_offset": _int_column(cols, "row_offset", hi=1 << 62),
        "length": length,
        "num_loss_tokens": _int_column(cols, "num_loss_tokens", hi=length),
        "source_row": _int_column(cols, "source_row", lo=lo, hi=lo + spec.rows_per_unit - 1),
        "source_hash": _hex_column(cols["source_hash"]),
        "split": _split_column(cols["split"]),
    }
    out = CommitColumns(
        unit=unit, attempt=attempt, accounting=accounting,
        slot=np.array([s.slot for s in slots], dtype=np.int64),
        num_rows=np.array([s.num_rows for s in slots], dtype=np.int64),
        crc32c=np.array([[s.crc32c[a] for a in arrays] for s in slots],
                        dtype=np.uint32).reshape(len(slots), len(arrays)),
        arrays=arrays, samples=samples)
    _check_placement(out, spec)
    return out


_INT_COLUMNS: Final = ("sample_id", "slot", "row_offset", "length", "num_loss_tokens",
                       "source_row")
_HEX_DIGITS: Final = b"0123456789abcdef"


def _int_column(cols: Mapping[str, list[Any]], name: str, *, lo: int = 0,
                hi: int | npt.NDArray[np.int64] = f.MAX_COUNT) -> npt.NDArray[np.int64]:
    """One column of JSON integers in ``[lo, hi]`` (``hi`` may differ per row), as int64."""
    values, field = cols[name], f"samples.{name}"
    if not set(map(type, values)) <= {int}:
        i = next(i for i, v in enumerate(values) if type(v) is not int)
        raise f.fail(f"{field}[{i}]", "an integer", values[i])
    try:
        column = np.fromiter(values, dtype=np.int64, count=len(values))
    except OverflowError:
        i = next(i for i, v in enumerate(values) if not -(1 << 63) <= v < 1 << 63)
        raise f.fail(f"{field}[{i}]", f"an integer in [{lo}, {hi}]", values[i]) from None
    bad = (column < lo) | (column > hi)
    if bad.any():
        i = int(np.argmax(bad))
        top = hi if isinstance(hi, int) else int(hi[i])
        raise f.fail(f"{field}[{i}]", f"an integer in [{lo}, {top}]", values[i])
    return column


def _hex_column(values: list[Any]) -> list[str]:
    """Every entry a lowercase hex digest (as :func:`fields.hexdigest` checks one)."""
    ok = set(map(type, values)) <= {str}
    if ok:
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        ok = bool(((lengths >= 1) & (lengths <= 256)).all())
    if ok:
        try:
            ok = not "".join(values).encode("ascii").translate(None, _HEX_DIGITS)
        except UnicodeEncodeError:
            ok = False
    if not ok:
        for i, v in enumerate(values):
            f.hexdigest(v, f"samples.source_hash[{i}]")
    return values


def _split_column(values: list[Any]) -> npt.NDArray[np.uint8]:
    """Every entry a split name, as its position in :data:`SPLITS`."""
    if not set(map(type, values)) <= {str} or not set(values) <= set(SPLITS):
        i = next(i for i, v in enumerate(values) if type(v) is not str or v not in SPLITS)
        f.choice(values[i], f"samples.split[{i}]", SPLITS)
    return np.fromiter(map(SPLITS[1].__eq__, values), dtype=np.uint8, count=len(values))


def _check_placement(c: CommitColumns, spec: CacheSpec) -> None:
    """Every sample lies in the used rows of the unit's listed slots, packed in order: it
    follows the previous sample where that one ends inside its slot and starts its slot
    otherwise; one longer than its slot's free rows starts a slot and runs over the next ones
    (``slot`` is the first); samples tile the slots' used rows exactly; ids are unique."""
    ids, slot = c.samples["sample_id"], c.samples["slot"]
    if np.unique(ids).size != ids.size:
        raise f.fail("samples.sample_id", "unique ids", ids[:20].tolist())
    listed = np.isin(slot, c.slot)
    if not listed.all():
        i = int(np.argmin(listed))
        raise f.fail(f"samples.slot[{i}]", f"one of the unit's slots {sorted(c.slot.tolist())}",
                     int(slot[i]))
    offset, length, sr = c.samples["row_offset"], c.samples["length"], spec.shard_rows
    order = np.argsort(slot, kind="stable")
    expected = np.empty_like(offset)
    expected[order] = _packed_offsets(slot[order], length[order], sr)
    first, last = sample_slots(spec, offset, length)
    rules = [("packed after the previous sample of its slot", offset != expected),
             ("in its slot", first != slot),
             ("at its slot's first row (it spans slots)", (last > first) & (offset != slot * sr))]
    for rule, wrong in rules:
        if wrong.any():
            i = int(np.argmax(wrong))
            raise f.fail(f"samples.row_offset[{i}]", f"{int(expected[i])} ({rule})",
                         int(offset[i]))
    _check_used_rows(c, sr, offset, offset + length)


def _packed_offsets(slot: npt.NDArray[np.int64], length: npt.NDArray[np.int64],
                    shard_rows: int) -> npt.NDArray[np.int64]:
    """Row offsets of samples in slot order: ``max(slot start, previous end)``, computed as
    the running maximum of ``slot start - rows before`` plus the rows before."""
    before = np.cumsum(length) - length
    out: npt.NDArray[np.int64] = before + np.maximum.accumulate(slot * shard_rows - before)
    return out


def _check_used_rows(c: CommitColumns, shard_rows: int, offset: npt.NDArray[np.int64],
                     end: npt.NDArray[np.int64]) -> None:
    """Every row of a sample spanning slots is in a listed slot, and each listed slot's
    ``num_rows`` is the rows its samples (or parts of them) occupy."""
    first, last = offset // shard_rows, (end - 1) // shard_rows
    spans = np.flatnonzero(last > first).tolist()
    sorter = np.argsort(c.slot)
    for i in spans:
        if not np.isin(np.arange(int(first[i]), int(last[i]) + 1), c.slot).all():
            raise f.fail(f"samples.length[{i}]", f"rows inside the unit's slots "
                         f"{sorted(c.slot.tolist())}", int(end[i] - offset[i]))
    row = sorter[np.searchsorted(c.slot, first, sorter=sorter)]
    used = np.bincount(row, weights=np.minimum(end, (first + 1) * shard_rows) - offset,
                       minlength=c.slot.size).astype(np.int64)
    for i in spans:
        for s in range(int(first[i]) + 1, int(last[i]) + 1):
            used[sorter[np.searchsorted(c.slot, s, sorter=sorter)]] += min(
                int(end[i]), (s + 1) * shard_rows) - s * shard_rows
    for s, have, want in zip(c.slot.tolist(), c.num_rows.tolist(), used.tolist(), strict=True):
        if have != want:
            raise f.fail("slots", f"slot {s} num_rows = rows of its samples ({want})", have)
