"""The manifest: versioned schema, one parse step per field, cross-field rules, JSON round trip."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, NotRequired, TypedDict

from sparkforge.manifests.parity import ParityInfo, parse_parity
from sparkforge.shared import fields as f
from sparkforge.shared.commit import SlotRecord, parse_accounting, parse_slots
from sparkforge.shared.fields import ManifestError
from sparkforge.shared.header import (
    CaptureInfo,
    DataInfo,
    RunHeader,
    TargetInfo,
    TokenizerInfo,
    parse_capture,
    parse_data,
    parse_target,
    parse_tokenizer,
)
from sparkforge.shared.layer_ids import hidden_states_range
from sparkforge.shared.layout import (
    FORMAT_VERSION,
    MAX_UNITS,
    READABLE_VERSIONS,
    CacheSpec,
    array_layouts,
    parse_spec,
)
from sparkforge.shared.records import UnitAccounting, sum_accounting
from sparkforge.shared.storage import UnsafeKeyError, safe_key

__all__ = ["FORMAT_VERSION", "MANIFEST_KEYS", "CacheIncompleteError", "CacheManifest",
           "ManifestError", "ManifestJSON", "TableRef", "UnknownFormatVersionError",
           "parse_manifest"]


class UnknownFormatVersionError(ManifestError):
    """Raised for a format_version this sparkforge cannot read."""


class CacheIncompleteError(ManifestError):
    """Raised when a cache lacks committed units or its manifest, so it must not be read."""


class ManifestJSON(TypedDict):
    """The on-disk JSON shape of ``manifest.json``."""

    format_version: int
    complete: bool
    created_at: str
    sparkforge_version: str
    git_sha: str | None
    producer_config: dict[str, Any]
    target: dict[str, Any]
    capture: dict[str, Any]
    tokenizer: dict[str, Any]
    data: dict[str, Any]
    accounting: dict[str, Any]
    storage: dict[str, Any]
    parity: NotRequired[dict[str, Any] | None]


# Spelled out: with postponed annotations, TypedDict cannot see NotRequired at run time.
OPTIONAL_MANIFEST_KEYS: Final = frozenset({"parity"})
MANIFEST_KEYS: Final = frozenset(ManifestJSON.__annotations__) - OPTIONAL_MANIFEST_KEYS


@dataclass(frozen=True, kw_only=True)
class ArrayInfo:
    """How one array is stored."""

    dtype: str
    dtype_logical: str
    row_shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class UnitEntry:
    """One committed unit as the manifest records it (its samples live in index.parquet)."""

    unit: int
    attempt: int
    slots: tuple[SlotRecord, ...]
    num_samples: int
    num_tokens: int
    accounting: UnitAccounting


@dataclass(frozen=True, kw_only=True)
class Totals:
    """Cache-wide totals."""

    samples: int
    tokens: int
    logical_bytes: int
    """Uncompressed bytes of all stored rows."""
    stored_bytes: int
    """Bytes of all objects in the store when finalized."""


@dataclass(frozen=True, kw_only=True)
class TableRef:
    """A Parquet table beside the manifest, which the manifest commits to by digest."""

    key: str
    sha256: str
    num_rows: int


_LEGACY: Final = {"optional_in_json": True}
"""Present in some format versions only: ``units`` up to format 2, the tables from format 3."""


@dataclass(frozen=True, kw_only=True)
class StorageInfo:
    """Arrays, codecs, chunking, the index, the unit and slot rows (with checksums), totals."""

    spec: CacheSpec
    arrays: dict[str, ArrayInfo]
    codecs: dict[str, str]
    """Array name -> human-readable codec chain, e.g. 'sharded blosc zstd-1 shuffle'
    (:func:`sparkforge.shared.layout.describe_codecs`)."""
    units: tuple[UnitEntry, ...] | None = dataclasses.field(default=None, metadata=_LEGACY)
    """Formats 1-2 only (read until sparkforge 0.4.0): every unit with its slots' checksums.
    From format 3 these rows are in ``unit_table`` and ``slot_table``."""
    index_key: str
    index_sha256: str
    unit_table: TableRef | None = dataclasses.field(default=None, metadata=_LEGACY)
    """Format 3: ``units.parquet``, one row per unit (attempt, counts, accounting)."""
    slot_table: TableRef | None = dataclasses.field(default=None, metadata=_LEGACY)
    """Format 3: ``slots.parquet``, one row per slot (used rows, a crc32c per array)."""
    totals: Totals

    @property
    def num_units(self) -> int:
        """Committed units."""
        return len(self.units) if self.units is not None else _rows(self.unit_table)

    @property
    def num_slots(self) -> int:
        """Committed slots."""
        if self.units is not None:
            return sum(len(u.slots) for u in self.units)
        return _rows(self.slot_table)


def _rows(table: TableRef | None) -> int:
    assert table is not None, "parse_storage requires the tables from format 3"
    return table.num_rows


@dataclass(frozen=True, kw_only=True)
class CacheManifest:
    """The producer -> trainer contract of one cache."""

    format_version: int
    complete: bool
    created_at: str
    sparkforge_version: str
    git_sha: str | None
    producer_config: dict[str, Any]
    target: TargetInfo
    capture: CaptureInfo
    tokenizer: TokenizerInfo
    data: DataInfo
    accounting: UnitAccounting
    storage: StorageInfo
    parity: ParityInfo | None = None
    """The producer's vLLM-vs-transformers parity report (per-layer errors, top-1, KL), if run;
    a copy of ``target/parity.json``."""

    @classmethod
    def from_json(cls, data: object) -> CacheManifest:
        """Parse and cross-check untrusted JSON. Raises ManifestError naming the field."""
        return parse_manifest(data)

    def to_json(self) -> ManifestJSON:
        """The manifest as JSON-ready data (tuples become lists)."""
        out: ManifestJSON = _lists(dataclasses.asdict(self))
        out["storage"]["spec"] = self.storage.spec.to_json()  # its version is format_version
        _drop_unset(out["data"], ("mix", "mix_seed"))
        _drop_unset(out["storage"], ("units", "unit_table", "slot_table"))
        units = out["storage"].get("units") or ()
        for accounting in (out["accounting"], *(u["accounting"] for u in units)):
            _drop_unset(accounting, ("image_rows",))
        for source in out["data"]["sources"]:
            _drop_unset(source, ("hf_dataset",))
        return out

    @property
    def header(self) -> RunHeader:
        """The producer-supplied sections."""
        return RunHeader(producer_config=self.producer_config, target=self.target,
                         capture=self.capture, tokenizer=self.tokenizer, data=self.data)


def _drop_unset(section: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Leave out optional keys that are unset, so older manifests round-trip unchanged."""
    for key in keys:
        if section.get(key) is None:
            section.pop(key, None)


def _lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_lists(v) for v in value]
    return value


def parse_format_version(data: object) -> int:
    """Only versions this code knows are accepted."""
    version = f.integer(data, "format_version", hi=1 << 16)
    if version not in READABLE_VERSIONS:
        raise UnknownFormatVersionError(
            f"manifest field 'format_version': this sparkforge reads versions "
            f"{list(READABLE_VERSIONS)}, got {version}; upgrade sparkforge or re-create the cache")
    return version


def parse_created_at(data: object) -> str:
    """An ISO 8601 timestamp with a timezone."""
    text = f.string(data, "created_at", max_len=64)
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError as exc:
        raise f.fail("created_at", "an ISO 8601 timestamp", data) from exc
    if stamp.tzinfo is None:
        raise f.fail("created_at", "an ISO 8601 timestamp with a timezone", data)
    return text


def parse_unit_entry(data: object, field: str, spec: CacheSpec) -> UnitEntry:
    """One entry of ``storage.units``."""
    d = f.obj(data, field, required=frozenset({"unit", "attempt", "slots", "num_samples",
                                               "num_tokens", "accounting"}))
    unit = f.integer(d["unit"], f"{field}.unit", hi=MAX_UNITS - 1)
    attempt = f.integer(d["attempt"], f"{field}.attempt", hi=999)
    entry = UnitEntry(
        unit=unit, attempt=attempt,
        slots=parse_slots(d["slots"], f"{field}.slots", spec=spec, unit=unit, attempt=attempt),
        num_samples=f.integer(d["num_samples"], f"{field}.num_samples", hi=spec.rows_per_unit),
        num_tokens=f.integer(d["num_tokens"], f"{field}.num_tokens"),
        accounting=parse_accounting(d["accounting"], f"{field}.accounting"))
    if entry.num_samples != entry.accounting.written:
        raise f.fail(f"{field}.num_samples", f"accounting.written = {entry.accounting.written}",
                     entry.num_samples)
    if entry.num_tokens != sum(s.num_rows for s in entry.slots):
        raise f.fail(f"{field}.num_tokens", "the sum of its slots' num_rows", entry.num_tokens)
    return entry


def parse_index_key(data: object) -> str:
    """The index path: a plain key inside the cache root."""
    try:
        return safe_key(f.string(data, "storage.index_key", max_len=256))
    except UnsafeKeyError as exc:
        raise f.fail("storage.index_key", "a relative key inside the cache root", data) from exc


def parse_table_ref(data: object, field: str, *, max_rows: int) -> TableRef:
    """A table beside the manifest: a key inside the cache root, its sha256 and row count."""
    d = f.obj(data, field, required=frozenset({"key", "sha256", "num_rows"}))
    try:
        key = safe_key(f.string(d["key"], f"{field}.key", max_len=256))
    except UnsafeKeyError as exc:
        raise f.fail(f"{field}.key", "a relative key inside the cache root", d["key"]) from exc
    return TableRef(key=key, sha256=f.hexdigest(d["sha256"], f"{field}.sha256", length=64),
                    num_rows=f.integer(d["num_rows"], f"{field}.num_rows", hi=max_rows))


def parse_storage(data: object, format_version: int = FORMAT_VERSION) -> StorageInfo:
    """The ``storage`` section: spec, arrays matching the spec (and its format version), the
    index, the units (up to format 2) or the unit and slot tables (from format 3), totals."""
    legacy = format_version < 3  # storage.units: read until sparkforge 0.4.0
    rows = frozenset({"units"} if legacy else {"unit_table", "slot_table"})
    d = f.obj(data, "storage", required=frozenset({"spec", "arrays", "codecs", "index_key",
                                                   "index_sha256", "totals"}) | rows)
    spec = parse_spec(d["spec"], format_version=format_version)
    layouts = array_layouts(spec)
    arrays_raw = f.obj(d["arrays"], "storage.arrays", required=frozenset(layouts))
    arrays = {}
    for name, layout in layouts.items():
        expected = {"dtype": str(layout.dtype), "dtype_logical": layout.dtype_logical,
                    "row_shape": list(layout.row_shape)}
        if arrays_raw[name] != expected:
            raise f.fail(f"storage.arrays.{name}", repr(expected), arrays_raw[name])
        arrays[name] = ArrayInfo(dtype=str(layout.dtype), dtype_logical=layout.dtype_logical,
                                 row_shape=layout.row_shape)
    codecs = f.obj(d["codecs"], "storage.codecs", required=frozenset(layouts))
    t = f.obj(d["totals"], "storage.totals",
              required=frozenset({"samples", "tokens", "logical_bytes", "stored_bytes"}))
    tables = {} if legacy else {
        "unit_table": parse_table_ref(d["unit_table"], "storage.unit_table", max_rows=MAX_UNITS),
        "slot_table": parse_table_ref(d["slot_table"], "storage.slot_table",
                                      max_rows=MAX_UNITS * spec.rows_per_unit)}
    return StorageInfo(
        spec=spec, arrays=arrays,
        codecs={k: f.string(v, f"storage.codecs.{k}", max_len=256) for k, v in codecs.items()},
        units=tuple(parse_unit_entry(u, f"storage.units[{i}]", spec) for i, u in
                    enumerate(f.array(d["units"], "storage.units", max_len=MAX_UNITS)))
        if legacy else None,
        index_key=parse_index_key(d["index_key"]),
        index_sha256=f.hexdigest(d["index_sha256"], "storage.index_sha256", length=64),
        totals=Totals(**{k: f.integer(t[k], f"storage.totals.{k}") for k in t}), **tables)


def parse_manifest(data: object) -> CacheManifest:
    """Parse every field, then apply the cross-field rules.

    Raises:
        ManifestError: naming the field and the bad value (UnknownFormatVersionError for
            versions this code cannot read).
    """
    d = f.obj(data, "<manifest>", required=MANIFEST_KEYS, optional=OPTIONAL_MANIFEST_KEYS)
    version = parse_format_version(d["format_version"])
    target = parse_target(d["target"])
    manifest = CacheManifest(
        format_version=version, complete=f.boolean(d["complete"], "complete"),
        created_at=parse_created_at(d["created_at"]),
        sparkforge_version=f.string(d["sparkforge_version"], "sparkforge_version", max_len=64),
        git_sha=f.optional(d["git_sha"], f.hexdigest, "git_sha"),
        producer_config=f.mapping(d["producer_config"], "producer_config"),
        target=target, capture=parse_capture(d["capture"], target),
        tokenizer=parse_tokenizer(d["tokenizer"]),
        data=parse_data(d["data"]), accounting=parse_accounting(d["accounting"]),
        storage=parse_storage(d["storage"], version),
        parity=f.optional(d.get("parity"), parse_parity, "parity"))
    check_cross_fields(manifest)
    return manifest


def check_cross_fields(m: CacheManifest) -> None:
    """Rules that tie sections together (spec vs target/capture, units vs totals/accounting;
    from format 3 the units' rules are checked where their table is read)."""
    spec, totals = m.storage.spec, m.storage.totals
    rules: list[tuple[bool, str, str, object]] = [
        (len(m.capture.layer_ids) == spec.num_aux_layers, "capture.layer_ids",
         f"{spec.num_aux_layers} ids (storage.spec.num_aux_layers)", list(m.capture.layer_ids)),
        (m.capture.layer_ids[-1] <= hidden_states_range(m.target.num_hidden_layers)[1],
         "capture.layer_ids",
         f"ids <= target.num_hidden_layers = {m.target.num_hidden_layers}",
         list(m.capture.layer_ids)),
        (m.target.hidden_size == spec.hidden_size, "target.hidden_size",
         f"storage.spec.hidden_size = {spec.hidden_size}", m.target.hidden_size),
        (m.capture.max_seq_len == spec.max_seq_len, "capture.max_seq_len",
         f"storage.spec.max_seq_len = {spec.max_seq_len}", m.capture.max_seq_len),
        (totals.samples == m.accounting.written, "storage.totals.samples",
         "accounting.written", totals.samples),
    ]
    units = m.storage.units
    if units is not None:  # formats 1-2
        rules += [
            ([u.unit for u in units] == sorted({u.unit for u in units}), "storage.units",
             "unique units in increasing order", [u.unit for u in units][:20]),
            (not m.complete or [u.unit for u in units] == list(range(len(units))),
             "storage.units", "units 0..n-1 without gaps in a complete cache",
             [u.unit for u in units][:20]),
            (totals.samples == sum(u.num_samples for u in units), "storage.totals.samples",
             "the sum of unit samples and accounting.written", totals.samples),
            (totals.tokens == sum(u.num_tokens for u in units), "storage.totals.tokens",
             "the sum of unit tokens", totals.tokens),
            (m.accounting == sum_accounting([u.accounting for u in units]), "accounting",
             "the sum of the units' accounting", dataclasses.asdict(m.accounting)),
        ]
    for ok, field, expected, value in rules:
        if not ok:
            raise f.fail(field, expected, value)
