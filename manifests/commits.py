"""Parse untrusted commit records into UnitInfo, checking every row against the unit and spec."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sparkforge.manifests import fields as f
from sparkforge.manifests.fields import ManifestError, load_json
from sparkforge.manifests.schema import parse_accounting, parse_slots
from sparkforge.shared.commit import SAMPLE_COLUMNS, SampleRow, UnitInfo
from sparkforge.shared.layout import CacheSpec


def parse_commit_bytes(raw: bytes, *, unit: int, spec: CacheSpec) -> UnitInfo:
    """Decode and parse the commit record stored for ``unit``."""
    data = load_json(raw, f"commit record of unit {unit}")
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
    f.choice(d["format_version"], "format_version", (1,))
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
