"""Commit records: what one committed unit holds (slots, checksums, sample rows, accounting).

:meth:`UnitInfo.to_bytes` writes a record and :func:`parse_commit_bytes` reads one back, checking
every row against the unit and the spec (the record is untrusted once it is in the store).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import numpy.typing as npt

from sparkforge.shared import fields as f
from sparkforge.shared import storage
from sparkforge.shared.fields import ManifestError
from sparkforge.shared.layout import (
    COMMITS_PREFIX,
    FORMAT_VERSION,
    CacheSpec,
    array_layouts,
    first_slot,
    parse_commit_name,
    slots_per_attempt,
)
from sparkforge.shared.records import Split, UnitAccounting

SAMPLE_COLUMNS = ("sample_id", "slot", "row_offset", "length", "num_loss_tokens", "source_row",
                  "source_hash", "split")


def committed_units(loc: storage.Location) -> set[int]:
    """Units whose commit record exists (listed fresh from the store)."""
    units = (parse_commit_name(n) for n in storage.list_names(loc, COMMITS_PREFIX))
    return {u for u in units if u is not None}


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

    def to_json(self, format_version: int = FORMAT_VERSION) -> dict[str, Any]:
        """The commit record as JSON (sample rows stored column-wise to stay compact)."""
        return {
            "format_version": format_version,
            "unit": self.unit,
            "attempt": self.attempt,
            "slots": [{"slot": s.slot, "num_rows": s.num_rows, "crc32c": dict(s.crc32c)}
                      for s in self.slots],
            "samples": {c: [getattr(s, c) for s in self.samples] for c in SAMPLE_COLUMNS},
            "accounting": accounting_json(self.accounting),
        }

    def to_bytes(self, format_version: int = FORMAT_VERSION) -> bytes:
        """Serialised commit record of a cache with this format version."""
        return json.dumps(self.to_json(format_version), sort_keys=True).encode()


def accounting_json(acc: UnitAccounting) -> dict[str, Any]:
    """An accounting as commit records and the manifest store it (``image_rows`` only when
    counted, so records written before it read back unchanged)."""
    out: dict[str, Any] = {"input_rows": acc.input_rows, "written": acc.written,
                           "skipped": dict(acc.skipped), "failed": acc.failed}
    if acc.image_rows is not None:
        out["image_rows"] = acc.image_rows
    return out


def parse_accounting(data: object, field: str = "accounting") -> UnitAccounting:
    """Input rows, written, skipped by reason, failed; the four must add up. ``image_rows``
    (optional) is at most ``written``."""
    d = f.obj(data, field, required=frozenset({"input_rows", "written", "skipped", "failed"}),
              optional=frozenset({"image_rows"}))
    skipped_raw = f.mapping(d["skipped"], f"{field}.skipped")
    skipped = {f.string(k, f"{field}.skipped", max_len=64): f.integer(v, f"{field}.skipped.{k}")
               for k, v in skipped_raw.items()}
    input_rows = f.integer(d["input_rows"], f"{field}.input_rows")
    written, failed = f.integer(d["written"], f"{field}.written"), f.integer(d["failed"],
                                                                             f"{field}.failed")
    if written + sum(skipped.values()) + failed != input_rows:
        raise ManifestError(
            f"manifest field {field!r}: written {written} + skipped {sum(skipped.values())} "
            f"+ failed {failed} != input_rows {input_rows}")
    image_rows = f.optional(d.get("image_rows"), f.integer, f"{field}.image_rows", hi=written)
    return UnitAccounting(input_rows=input_rows, written=written, skipped=skipped, failed=failed,
                          image_rows=image_rows)


def parse_slots(data: object, field: str, *, spec: CacheSpec, unit: int,
                attempt: int) -> tuple[SlotRecord, ...]:
    """Slots of one (unit, attempt): inside its slot range, with one crc32c per array."""
    lo = first_slot(spec, unit, attempt)
    names = frozenset(array_layouts(spec))
    out = []
    for i, item in enumerate(f.array(data, field, max_len=slots_per_attempt(spec))):
        d = f.obj(item, f"{field}[{i}]", required=frozenset({"slot", "num_rows", "crc32c"}))
        crc = f.obj(d["crc32c"], f"{field}[{i}].crc32c", required=names)
        out.append(SlotRecord(
            slot=f.integer(d["slot"], f"{field}[{i}].slot", lo=lo,
                           hi=lo + slots_per_attempt(spec) - 1),
            num_rows=f.integer(d["num_rows"], f"{field}[{i}].num_rows", lo=1, hi=spec.shard_rows),
            crc32c={k: f.integer(v, f"{field}[{i}].crc32c.{k}", hi=0xFFFFFFFF)
                    for k, v in crc.items()}))
    return tuple(out)


def parse_commit_bytes(raw: bytes, *, unit: int, spec: CacheSpec) -> UnitInfo:
    """Decode and parse the commit record stored for ``unit``."""
    data = f.load_json(raw, f"commit record of unit {unit}")
    try:
        return parse_commit_record(data, unit=unit, spec=spec)
    except ManifestError as exc:
        raise ManifestError(f"commit record of unit {unit}: {exc}") from exc


def parse_commit_record(data: object, *, unit: int, spec: CacheSpec) -> UnitInfo:
    """A commit record whose slots, rows and accounting are consistent with ``unit``.

    Raises:
        ManifestError: naming the field, e.g. ``samples.row_offset[3]``.
    """
    d = f.obj(data, "commit", required=frozenset({"format_version", "unit", "attempt", "slots",
                                                  "samples", "accounting"}))
    f.choice(d["format_version"], "format_version", (spec.format_version,))
    if f.integer(d["unit"], "unit") != unit:
        raise f.fail("unit", f"{unit} (the unit named by the record's key)", d["unit"])
    attempt = f.integer(d["attempt"], "attempt", hi=999)
    slots = parse_slots(d["slots"], "slots", spec=spec, unit=unit, attempt=attempt)
    accounting = parse_accounting(d["accounting"])
    cols = f.obj(d["samples"], "samples", required=frozenset(SAMPLE_COLUMNS))
    n = accounting.written
    for name in SAMPLE_COLUMNS:
        if len(f.array(cols[name], f"samples.{name}", max_len=spec.rows_per_unit)) != n:
            raise f.fail(f"samples.{name}", f"{n} entries (accounting.written)", len(cols[name]))
    rows = tuple(_parse_row(cols, i, unit=unit, spec=spec) for i in range(n))
    _check_placement(rows, slots={s.slot: s.num_rows for s in slots}, spec=spec)
    return UnitInfo(unit=unit, attempt=attempt, slots=slots, samples=rows, accounting=accounting)


def _parse_row(cols: Mapping[str, Any], i: int, *, unit: int,
               spec: CacheSpec) -> SampleRow:
    lo, hi = unit * spec.rows_per_unit, (unit + 1) * spec.rows_per_unit - 1
    length = f.integer(cols["length"][i], f"samples.length[{i}]", lo=1, hi=spec.max_seq_len)
    return SampleRow(
        sample_id=f.integer(cols["sample_id"][i], f"samples.sample_id[{i}]"),
        slot=f.integer(cols["slot"][i], f"samples.slot[{i}]"),
        row_offset=f.integer(cols["row_offset"][i], f"samples.row_offset[{i}]", hi=1 << 62),
        length=length,
        num_loss_tokens=f.integer(cols["num_loss_tokens"][i], f"samples.num_loss_tokens[{i}]",
                                  hi=length),
        source_row=f.integer(cols["source_row"][i], f"samples.source_row[{i}]", lo=lo, hi=hi),
        source_hash=f.hexdigest(cols["source_hash"][i], f"samples.source_hash[{i}]"),
        split=f.choice(cols["split"][i], f"samples.split[{i}]", ("train", "eval")),
    )


def _check_placement(rows: tuple[SampleRow, ...], *, slots: dict[int, int],
                     spec: CacheSpec) -> None:
    """Every sample lies inside the used rows of a listed slot; samples tile the slots exactly."""
    used = dict.fromkeys(slots, 0)
    if len({r.sample_id for r in rows}) != len(rows):
        raise f.fail("samples.sample_id", "unique ids", [r.sample_id for r in rows][:20])
    for i, r in enumerate(rows):
        if r.slot not in slots:
            raise f.fail(f"samples.slot[{i}]", f"one of the unit's slots {sorted(slots)}", r.slot)
        expected = r.slot * spec.shard_rows + used[r.slot]
        if r.row_offset != expected:
            raise f.fail(f"samples.row_offset[{i}]", f"{expected} (packed after the previous "
                         "sample of its slot)", r.row_offset)
        used[r.slot] += r.length
    for slot, num_rows in slots.items():
        if used[slot] != num_rows:
            raise f.fail("slots", f"slot {slot} num_rows = rows of its samples ({used[slot]})",
                         num_rows)
