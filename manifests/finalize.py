"""Finalize a cache: from the commit records alone, write index.parquet, then manifest.json last."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from sparkforge.manifests.commits import CommitCollector, read_commits
from sparkforge.manifests.index import INDEX_SCHEMA
from sparkforge.manifests.index_rows import BATCH_ROWS, IndexBatches, SortedRows
from sparkforge.manifests.objects import (
    MAX_HEADER_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_PARITY_BYTES,
    object_totals,
    read_json,
)
from sparkforge.manifests.schema import (
    CacheIncompleteError,
    CacheManifest,
    parse_format_version,
)
from sparkforge.manifests.tables import (
    SLOT_TABLE_KEY,
    UNIT_TABLE_KEY,
    slot_table_bytes,
    table_ref,
    unit_table_bytes,
)
from sparkforge.manifests.units import UnitColumns
from sparkforge.shared import storage
from sparkforge.shared.cache_tables import SlotColumns
from sparkforge.shared.commit import accounting_json, committed_units
from sparkforge.shared.commit_columns import CommitColumns
from sparkforge.shared.fields import ManifestError
from sparkforge.shared.header import RunHeader
from sparkforge.shared.layout import (
    HEADER_KEY,
    INDEX_KEY,
    MANIFEST_KEY,
    PARITY_FILE,
    TARGET_PREFIX,
    CacheSpec,
    array_layouts,
    compressor,
    describe_codecs,
    parse_spec,
)
from sparkforge.shared.provenance import git_sha, package_version

logger = logging.getLogger(__name__)


def read_run_header(loc: storage.Location) -> tuple[CacheSpec, RunHeader]:
    """The spec and the producer header stored at creation."""
    try:
        data = read_json(loc, HEADER_KEY, max_bytes=MAX_HEADER_BYTES)
    except FileNotFoundError as exc:
        raise CacheIncompleteError(f"{loc.uri} has no {HEADER_KEY}: not a sparkforge cache")\
            from exc
    if not isinstance(data, dict) or set(data) != {"format_version", "spec", "header"}:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ManifestError(f"{loc.uri}/{HEADER_KEY}: expected exactly the keys "
                            f"['format_version', 'header', 'spec'], got {got}")
    version = parse_format_version(data["format_version"])
    return (parse_spec(data["spec"], "spec", format_version=version),
            RunHeader.from_json(data["header"]))


def finalize_run(uri: str, *, storage_options: Mapping[str, Any] | None = None,
                 max_concurrency: int = storage.DEFAULT_MAX_CONCURRENCY) -> CacheManifest:
    """``sparkforge finalize``: :func:`finalize_cache` with the unit count from the run header.

    Raises:
        CacheIncompleteError: listing the missing units.
    """
    _, header = read_run_header(storage.open_location(uri, storage_options))
    return finalize_cache(uri, expected_units=header.num_units, storage_options=storage_options,
                          max_concurrency=max_concurrency)


def finalize_cache(uri: str, *, expected_units: int,
                   storage_options: Mapping[str, Any] | None = None,
                   max_concurrency: int = storage.DEFAULT_MAX_CONCURRENCY) -> CacheManifest:
    """Write index.parquet and manifest.json (complete) once every unit is committed.

    Idempotent: an existing complete manifest over the same units is returned unchanged.
    ``max_concurrency`` commit records are read at once.

    Raises:
        CacheIncompleteError: listing the missing units.
        ManifestError: if a commit record is malformed or sample ids repeat across units.
    """
    loc = storage.open_location(uri, storage_options)
    spec, header = read_run_header(loc)
    committed = committed_units(loc, spec)
    missing = sorted(set(range(expected_units)) - committed)
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        raise CacheIncompleteError(f"{uri}: {len(missing)} of {expected_units} units are not "
                                   f"committed yet: {shown}")
    extra = sorted(committed - set(range(expected_units)))
    if extra:
        raise ManifestError(f"{uri}: units {extra[:20]} are committed but expected_units is "
                            f"{expected_units}")
    if storage.exists(loc, MANIFEST_KEY):
        existing = CacheManifest.from_json(read_json(loc, MANIFEST_KEY,
                                                     max_bytes=MAX_MANIFEST_BYTES))
        if existing.complete and existing.storage.num_units == expected_units:
            return existing
    collector = CommitCollector(tuple(array_layouts(spec)))
    index_sha256 = _write_index(loc, spec, range(expected_units), collector, max_concurrency)
    rows = _write_tables(loc, spec, collector.units(), collector.slots())
    manifest = CacheManifest.from_json(_manifest_json(loc, spec, header, collector, index_sha256,
                                                      rows))
    storage.atomic_write(loc, MANIFEST_KEY, json.dumps(manifest.to_json(), indent=1).encode())
    logger.info("finalized %s: %d units, %d samples, %d tokens", uri, expected_units,
                manifest.storage.totals.samples, manifest.storage.totals.tokens)
    return manifest


def _write_index(loc: storage.Location, spec: CacheSpec, units: range, collector: CommitCollector,
                 max_concurrency: int) -> str:
    """Read every commit record into ``collector`` and write index.parquet as they come, one row
    group per :data:`BATCH_ROWS` rows (sample ids rise with units); if they do not, read the
    records again and write them sorted. Returns the index's sha256.

    Raises:
        ManifestError: a malformed record, or a sample id in more than one unit.
    """
    batches = IndexBatches()
    with storage.staged_file(loc, INDEX_KEY) as path:
        with pq.ParquetWriter(path, INDEX_SCHEMA, compression="zstd") as out:
            for record in _records(loc, spec, units, max_concurrency):
                collector.add(record)
                if (batch := batches.add(record)) is not None:
                    out.write_batch(batch)
            if (batch := batches.rest()) is not None:
                out.write_batch(batch)
        if not batches.in_order:
            rows = SortedRows()
            for record in _records(loc, spec, units, max_concurrency):
                rows.add(record)
            pq.write_table(rows.table(), path, compression="zstd", row_group_size=BATCH_ROWS)
        with Path(path).open("rb") as f:
            return storage.stream_sha256(f)


def _records(loc: storage.Location, spec: CacheSpec, units: range,
             max_concurrency: int) -> Iterator[CommitColumns]:
    for _, record in read_commits(loc, spec, units, max_concurrency=max_concurrency):
        if not isinstance(record, CommitColumns):
            raise record
        yield record


def _write_tables(loc: storage.Location, spec: CacheSpec, units: UnitColumns,
                  slots: SlotColumns) -> dict[str, Any]:
    """The manifest's unit and slot rows: written as tables from format 3 (the manifest holds
    their digests), listed in ``storage.units`` before it (until sparkforge 0.4.0)."""
    if spec.format_version < 3:
        return {"units": _unit_entries(units, slots)}
    out = {}
    for field, key, raw, n in [("unit_table", UNIT_TABLE_KEY, unit_table_bytes(units), len(units)),
                               ("slot_table", SLOT_TABLE_KEY, slot_table_bytes(slots), len(slots))]:
        storage.atomic_write(loc, key, raw)
        out[field] = table_ref(key, raw, n)
    return out


def _manifest_json(loc: storage.Location, spec: CacheSpec, header: RunHeader,
                   collector: CommitCollector, index_sha256: str,
                   rows: dict[str, Any]) -> dict[str, Any]:
    layouts = array_layouts(spec)
    units = collector.units()
    tokens = int(units.num_tokens.sum())
    row_bytes = sum(a.dtype.itemsize * math.prod(a.row_shape) for a in layouts.values())
    return {
        "format_version": spec.format_version, "complete": True,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "sparkforge_version": package_version("sparkforge") or "0+unknown", "git_sha": git_sha(),
        **header.to_json(),
        "accounting": accounting_json(units.total()),
        "storage": {
            "spec": spec.to_json(),
            "arrays": {n: {"dtype": str(a.dtype), "dtype_logical": a.dtype_logical,
                           "row_shape": list(a.row_shape)} for n, a in layouts.items()},
            "codecs": {n: describe_codecs([compressor(a, spec)], sharded=a.blosc)
                       for n, a in layouts.items()},
            **rows,
            "index_key": INDEX_KEY, "index_sha256": index_sha256,
            "totals": {"samples": int(units.num_samples.sum()), "tokens": tokens,
                       "logical_bytes": tokens * row_bytes,
                       "stored_bytes": object_totals(loc, spec)[1]},
        },
        "parity": _parity_report(loc),
    }


def _unit_entries(units: UnitColumns, slots: SlotColumns) -> list[dict[str, Any]]:
    """``storage.units``: each unit with its slots' checksums and its accounting."""
    out = []
    for i, unit in enumerate(units.unit.tolist()):
        rows = slots.of_unit(unit)
        out.append({"unit": unit, "attempt": int(units.attempt[i]),
                    "slots": [{"slot": s, "num_rows": n, "crc32c": slots.checksums(k)}
                              for k, s, n in zip(range(rows.start, rows.stop),
                                                 slots.slot[rows].tolist(),
                                                 slots.num_rows[rows].tolist(), strict=True)],
                    "num_samples": int(units.num_samples[i]),
                    "num_tokens": int(units.num_tokens[i]),
                    "accounting": accounting_json(units.accounting(i))})
    return out


def _parity_report(loc: storage.Location) -> Any:
    """The producer's parity report (``target/parity.json``), or None when none was run."""
    key = f"{TARGET_PREFIX}/{PARITY_FILE}"
    return read_json(loc, key, max_bytes=MAX_PARITY_BYTES) if storage.exists(loc, key) else None
