"""The manifest's unit and slot rows: ``units.parquet`` and ``slots.parquet`` beside the index.

From format 3 the manifest holds no per-unit or per-slot entry (which made it grow by ~213 bytes
per slot): finalize writes one row per unit (attempt, counts, accounting) and one per slot (used
rows, a crc32c per array) as Parquet, and the manifest commits to each by its sha256 and row
count, so a swapped or edited table is refused before any row is used. Older manifests list the
same rows in ``storage.units`` (read until sparkforge 0.4.0); :func:`read_tables` returns the
columns either way.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sparkforge.manifests.schema import CacheManifest, TableRef
from sparkforge.manifests.units import ABSENT, UnitColumns
from sparkforge.shared import storage
from sparkforge.shared.cache_tables import SlotColumns
from sparkforge.shared.fields import ManifestError
from sparkforge.shared.layout import MAX_ATTEMPTS, array_layouts, slots_per_attempt

UNIT_TABLE_KEY: Final = "units.parquet"
SLOT_TABLE_KEY: Final = "slots.parquet"
UNIT_COLUMNS: Final = ("unit", "attempt", "num_samples", "num_tokens", "input_rows", "written",
                       "failed", "image_rows")
"""int64 columns of units.parquet, then one ``skipped.<reason>`` column per skip reason."""
SKIPPED: Final = "skipped."
CRC32C: Final = "crc32c."
"""slots.parquet: int64 ``unit``, ``slot``, ``num_rows``, then a uint32 ``crc32c.<array>`` column
per array of the cache."""


def unit_table_bytes(units: UnitColumns) -> bytes:
    """units.parquet: one row per unit (:data:`ABSENT` where a unit lacks a count)."""
    columns = {name: getattr(units, name) for name in UNIT_COLUMNS}
    columns |= {f"{SKIPPED}{reason}": counts for reason, counts in units.skipped.items()}
    return _parquet(pa.table({k: pa.array(v, pa.int64()) for k, v in columns.items()}))


def slot_table_bytes(slots: SlotColumns) -> bytes:
    """slots.parquet: one row per slot, sorted by (unit, slot)."""
    columns: dict[str, Any] = {name: pa.array(getattr(slots, name), pa.int64())
                               for name in ("unit", "slot", "num_rows")}
    columns |= {f"{CRC32C}{name}": pa.array(slots.crc32c[:, j], pa.uint32())
                for j, name in enumerate(slots.arrays)}
    return _parquet(pa.table(columns))


def table_ref(key: str, raw: bytes, num_rows: int) -> dict[str, Any]:
    """How the manifest names a table: its key, sha256 and row count."""
    return {"key": key, "sha256": hashlib.sha256(raw).hexdigest(), "num_rows": num_rows}


def _parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=256 * 1024)
    return buf.getvalue()


def read_tables(loc: storage.Location, m: CacheManifest) -> tuple[UnitColumns, SlotColumns]:
    """The cache's unit rows and slot rows, checked against the manifest and each other.

    Raises:
        ManifestError: a table is missing, unreadable, not the one the manifest commits to, or
            breaks a rule (naming the table, the column and the first offending row).
    """
    if m.storage.units is not None:  # formats 1-2: read until sparkforge 0.4.0
        return _from_manifest(m)
    unit_ref, slot_ref = m.storage.unit_table, m.storage.slot_table
    assert unit_ref is not None, "parse_storage requires both tables from format 3"
    assert slot_ref is not None, "parse_storage requires both tables from format 3"
    units = _units(_read(loc, unit_ref, "unit_table"), unit_ref.key, m)
    return units, _slots(_read(loc, slot_ref, "slot_table"), slot_ref.key, m, units)


def read_slot_table(loc: storage.Location, m: CacheManifest) -> SlotColumns:
    """The committed slots as columns (see :func:`read_tables`)."""
    return read_tables(loc, m)[1]


def _from_manifest(m: CacheManifest) -> tuple[UnitColumns, SlotColumns]:
    entries = m.storage.units or ()
    units = UnitColumns.from_rows((e.unit, e.attempt, e.num_samples, e.num_tokens, e.accounting)
                                  for e in entries)
    return units, SlotColumns.from_units(entries, tuple(array_layouts(m.storage.spec)))


def _read(loc: storage.Location, ref: TableRef, field: str) -> pa.Table:
    """The table's bytes, checked against the manifest's digest and row count."""
    where = f"{ref.key} (manifest storage.{field})"
    try:
        raw = storage.read_bytes(loc, ref.key)
    except FileNotFoundError as exc:
        raise ManifestError(f"{where} is missing; the cache cannot be read") from exc
    digest = hashlib.sha256(raw).hexdigest()
    if digest != ref.sha256:
        raise ManifestError(f"{where}: sha256 {digest} != manifest storage.{field}.sha256 "
                            f"{ref.sha256} (a table other than the one finalize wrote)")
    try:
        table = pq.read_table(io.BytesIO(raw))
    except pa.ArrowException as exc:
        raise ManifestError(f"{where}: not a readable Parquet file ({exc})") from exc
    if table.num_rows != ref.num_rows:
        raise ManifestError(f"{where}: {table.num_rows} rows != manifest "
                            f"storage.{field}.num_rows {ref.num_rows}")
    return table


def _columns(table: pa.Table, key: str, types: dict[str, pa.DataType]) -> dict[str, Any]:
    """Named columns of the expected types as numpy arrays (no nulls)."""
    have = {f.name: f.type for f in table.schema}
    if have != types:
        raise ManifestError(f"{key}: columns {_shown(have)} != {_shown(types)}")
    if any(table.column(name).null_count for name in types):
        raise ManifestError(f"{key}: a column has nulls")
    return {name: table.column(name).to_numpy() for name in types}


def _shown(types: dict[str, pa.DataType]) -> str:
    return ", ".join(f"{name}: {kind}" for name, kind in types.items())


def _fail(key: str, column: str, rule: str, bad: np.ndarray) -> ManifestError:
    row = int(np.argmax(bad))
    return ManifestError(f"{key}: row {row}: {column} breaks the rule: {rule}")


def _units(table: pa.Table, key: str, m: CacheManifest) -> UnitColumns:
    reasons = [n[len(SKIPPED):] for n in table.schema.names if n.startswith(SKIPPED)]
    types = {name: pa.int64() for name in (*UNIT_COLUMNS, *(SKIPPED + r for r in reasons))}
    c = _columns(table, key, types)
    skipped = {r: c[SKIPPED + r] for r in reasons}
    listed = sum((np.maximum(v, 0) for v in skipped.values()), np.zeros(len(table), np.int64))
    rules = [("unit", "units 0..n-1 in order", c["unit"] != np.arange(len(table))),
             ("attempt", f"in [0, {MAX_ATTEMPTS})",
              (c["attempt"] < 0) | (c["attempt"] >= MAX_ATTEMPTS)),
             ("written", "written + skipped + failed = input_rows",
              c["written"] + listed + c["failed"] != c["input_rows"]),
             ("num_samples", "num_samples = written", c["num_samples"] != c["written"]),
             ("image_rows", f"{ABSENT} or in [0, written]",
              (c["image_rows"] < ABSENT) | (c["image_rows"] > c["written"])),
             *((name, ">= 0", c[name] < 0) for name in UNIT_COLUMNS[2:7]),
             *((SKIPPED + r, f"{ABSENT} or >= 0", v < ABSENT) for r, v in skipped.items())]
    for column, rule, bad in rules:
        if bad.any():
            raise _fail(key, column, rule, bad)
    units = UnitColumns(**{name: c[name] for name in UNIT_COLUMNS}, skipped=skipped)
    totals = m.storage.totals
    for what, have, want in [("accounting", units.total(), m.accounting),
                             ("samples", int(units.num_samples.sum()), totals.samples),
                             ("tokens", int(units.num_tokens.sum()), totals.tokens)]:
        if have != want:
            raise ManifestError(f"{key}: the units' {what} add up to {have!r}, the manifest "
                                f"records {want!r}")
    return units


def _slots(table: pa.Table, key: str, m: CacheManifest, units: UnitColumns) -> SlotColumns:
    spec = m.storage.spec
    arrays = tuple(array_layouts(spec))
    types = {"unit": pa.int64(), "slot": pa.int64(), "num_rows": pa.int64(),
             **{CRC32C + name: pa.uint32() for name in arrays}}
    c = _columns(table, key, types)
    unit, slot, rows = c["unit"], c["slot"], c["num_rows"]
    inside = (unit >= 0) & (unit < len(units))
    attempt = units.attempt[np.where(inside, unit, 0)]
    owner = slot // slots_per_attempt(spec)  # = unit * MAX_ATTEMPTS + attempt
    same_unit = unit[1:] == unit[:-1]
    order = np.r_[True, (unit[1:] > unit[:-1]) | (same_unit & (slot[1:] > slot[:-1]))]
    tokens = np.bincount(np.where(inside, unit, 0), weights=rows, minlength=len(units))
    rules = [("unit", "a unit of the cache", ~inside),
             ("slot", "sorted by (unit, slot), each once", ~order),
             ("slot", "inside its unit's attempt's slot range",
              owner != unit * MAX_ATTEMPTS + attempt),
             ("num_rows", f"in [1, {spec.shard_rows}]", (rows < 1) | (rows > spec.shard_rows))]
    for column, rule, bad in rules:
        if bad.any():
            raise _fail(key, column, rule, bad)
    wrong = tokens.astype(np.int64) != units.num_tokens
    if wrong.any():
        u = int(np.argmax(wrong))
        raise ManifestError(f"{key}: unit {u}'s slots hold {int(tokens[u])} rows, "
                            f"{UNIT_TABLE_KEY} says num_tokens {int(units.num_tokens[u])}")
    return SlotColumns.from_columns(unit=unit, slot=slot, num_rows=rows, arrays=arrays,
                                    crc32c=np.stack([c[CRC32C + a] for a in arrays], axis=1)
                                    .reshape(len(table), len(arrays)))
