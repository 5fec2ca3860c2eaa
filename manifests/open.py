"""The trainer's entry point: open a finalized cache through its manifest and index."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from sparkforge.manifests.index import check_index
from sparkforge.manifests.schema import CacheIncompleteError, CacheManifest
from sparkforge.shared import storage
from sparkforge.shared.commit import SampleRow, UnitInfo
from sparkforge.shared.fields import ManifestError
from sparkforge.shared.layout import MANIFEST_KEY
from sparkforge.shared.reader import CacheReader


def read_manifest(loc: storage.Location) -> CacheManifest:
    """Parse ``manifest.json``; a cache without one (or not complete) is refused.

    Raises:
        CacheIncompleteError: no manifest or ``complete`` is false.
        ManifestError: the manifest is malformed.
    """
    try:
        raw = storage.read_bytes(loc, MANIFEST_KEY)
    except FileNotFoundError as exc:
        raise CacheIncompleteError(
            f"{loc.uri} has no {MANIFEST_KEY}: the cache is incomplete (still being written, or "
            "crashed before `sparkforge finalize`); refusing to read it") from exc
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ManifestError(f"{loc.uri}/{MANIFEST_KEY} is not valid JSON: {exc}") from exc
    manifest = CacheManifest.from_json(data)
    if not manifest.complete:
        raise CacheIncompleteError(f"{loc.uri}: manifest says complete=false; refusing to read")
    return manifest


def read_index(loc: storage.Location, manifest: CacheManifest) -> pa.Table:
    """Load index.parquet after checking its sha256, schema and row count against the manifest."""
    table, problems = check_index(storage.read_bytes(loc, manifest.storage.index_key), manifest)
    if problems or table is None:
        raise ManifestError("; ".join(problems))
    return table


def units_from_index(manifest: CacheManifest, index: pa.Table) -> list[UnitInfo]:
    """Rebuild each committed unit's sample rows (storage order) from the index."""
    rows: dict[int, list[SampleRow]] = {u.unit: [] for u in manifest.storage.units}
    for r in index.to_pylist():
        unit = r.pop("unit")
        if unit not in rows:
            raise ManifestError(f"index row for sample {r['sample_id']} names unit {unit}, "
                                "which the manifest does not list")
        rows[unit].append(SampleRow(**r))
    return [UnitInfo(unit=u.unit, attempt=u.attempt, slots=u.slots,
                     samples=tuple(sorted(rows[u.unit], key=lambda s: s.row_offset)),
                     accounting=u.accounting)
            for u in manifest.storage.units]


def open_cache(uri: str, *, storage_options: Mapping[str, Any] | None = None,
               verify: bool = False) -> CacheReader[CacheManifest]:
    """Parse and check the manifest, then return a reader over the committed units.

    Args:
        uri: local path or fsspec URI of the cache.
        storage_options: fsspec options (e.g. S3 endpoint and credentials).
        verify: check each slot's crc32c as it is read.

    Raises:
        CacheIncompleteError: the cache has no complete manifest.
        ManifestError: the manifest or index is malformed.
    """
    loc = storage.open_location(uri, storage_options)
    manifest = read_manifest(loc)
    index = read_index(loc, manifest)
    return CacheReader(loc, manifest.storage.spec, units_from_index(manifest, index), index,
                       manifest, verify=verify)
