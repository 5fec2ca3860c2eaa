"""The trainer's entry point: open a finalized cache through its manifest, index and commits."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from sparkforge.manifests.index import check_index
from sparkforge.manifests.objects import MAX_COMMIT_BYTES, MAX_MANIFEST_BYTES, read_json
from sparkforge.manifests.schema import CacheIncompleteError, CacheManifest
from sparkforge.shared import storage
from sparkforge.shared.commit import SampleRow, UnitInfo, parse_commit_bytes
from sparkforge.shared.fields import ManifestError
from sparkforge.shared.layer_ids import feature_positions
from sparkforge.shared.layout import MANIFEST_KEY, TARGET_PREFIX, CacheSpec, commit_key
from sparkforge.shared.reader import CacheReader
from sparkforge.shared.target_config import parse_target_config

logger = logging.getLogger(__name__)


class IndexMismatchError(ManifestError):
    """Raised when index.parquet or the manifest disagrees with a unit's commit record."""


def read_manifest(loc: storage.Location) -> CacheManifest:
    """Parse ``manifest.json``; a cache without one (or not complete) is refused.

    Raises:
        CacheIncompleteError: no manifest or ``complete`` is false.
        ManifestError: the manifest is malformed.
        ValueError: the manifest is too large or a link out of a local cache root.
    """
    try:
        data = read_json(loc, MANIFEST_KEY, max_bytes=MAX_MANIFEST_BYTES)
    except FileNotFoundError as exc:
        raise CacheIncompleteError(
            f"{loc.uri} has no {MANIFEST_KEY}: the cache is incomplete (still being written, or "
            "crashed before `sparkforge finalize`); refusing to read it") from exc
    manifest = CacheManifest.from_json(data)
    if not manifest.complete:
        raise CacheIncompleteError(f"{loc.uri}: manifest says complete=false; refusing to read")
    return manifest


def cache_target_config(uri: str,
                        storage_options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The target ``config.json`` stored in the cache (the one ``train`` builds its draft from);
    None, with a warning, when it cannot be read."""
    key = f"{TARGET_PREFIX}/config.json"
    try:
        loc = storage.open_location(uri, storage_options)
        return dict(parse_target_config(storage.read_bytes(loc, key), f"{uri}/{key}").raw)
    except (OSError, ValueError) as exc:
        logger.warning("%s/%s unreadable (%s): the draft's embedding scale and logit softcap "
                       "are not checked", uri, key, exc)
        return None


def read_index(loc: storage.Location, manifest: CacheManifest) -> pa.Table:
    """Load index.parquet after checking its sha256, schema and row count against the manifest.

    Raises:
        ManifestError: the index is missing, unreadable or disagrees with the manifest.
    """
    key = manifest.storage.index_key
    try:
        raw = storage.read_bytes(loc, key)
    except FileNotFoundError as exc:
        raise ManifestError(f"{key} is missing (manifest storage.index_key); the cache cannot "
                            "be read") from exc
    table, problems = check_index(raw, manifest)
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


def unit_differences(listed: UnitInfo, committed: UnitInfo) -> list[str]:
    """How a unit as the manifest and index describe it differs from its commit record."""
    out = [f"{name}: manifest has {getattr(listed, name)!r}, commit record "
           f"{getattr(committed, name)!r}" for name in ("attempt", "slots", "accounting")
           if getattr(listed, name) != getattr(committed, name)]
    mine = {s.sample_id: s for s in committed.samples}
    for s in listed.samples:
        c = mine.pop(s.sample_id, None)
        if c is None:
            out.append(f"sample {s.sample_id}: in index.parquet, not in the commit record")
        elif c != s:
            out += [f"sample {s.sample_id}: index.parquet has {k} = {getattr(s, k)!r}, commit "
                    f"record {getattr(c, k)!r}" for k in vars(s) if getattr(s, k) != getattr(c, k)]
    out += [f"sample {sid}: in the commit record, not in index.parquet" for sid in sorted(mine)]
    return out


def commit_check(loc: storage.Location, spec: CacheSpec) -> Callable[[UnitInfo], None]:
    """A reader callback: a unit's boundaries must be the ones its commit record holds.

    Raises (from the callback):
        IndexMismatchError: naming the unit and the first differences.
    """
    def check(listed: UnitInfo) -> None:
        where = f"unit {listed.unit}"
        try:
            raw = storage.read_bytes(loc, commit_key(listed.unit), max_bytes=MAX_COMMIT_BYTES)
        except FileNotFoundError as exc:
            raise IndexMismatchError(f"{where}: commit record {commit_key(listed.unit)} is "
                                     "missing") from exc
        problems = unit_differences(listed, parse_commit_bytes(raw, unit=listed.unit, spec=spec))
        if problems:
            raise IndexMismatchError(f"{where}: the index or manifest disagrees with the commit "
                                     f"record: {'; '.join(problems[:3])}; run `sparkforge "
                                     "validate`")
    return check


def open_cache(uri: str, *, storage_options: Mapping[str, Any] | None = None,
               verify: bool = True,
               features: Sequence[int] | None = None) -> CacheReader[CacheManifest]:
    """Parse and check the manifest, then return a reader over the committed units.

    Sample boundaries come from the index (one read for the whole cache) and are cross-checked
    with each unit's commit record when the unit is first read.

    Args:
        uri: local path or fsspec URI of the cache.
        storage_options: fsspec options (e.g. S3 endpoint and credentials).
        verify: check each slot's crc32c as it is read.
        features: feature ids (a draft's ``target_layer_ids``) whose layers each sample's
            ``aux_hidden`` keeps, in this order; any subset of the captured ones. None keeps all.

    Raises:
        CacheIncompleteError: the cache has no complete manifest.
        ManifestError: the manifest or index is malformed.
        LayerIdError: ``features`` names ids the cache did not capture.
    """
    loc = storage.open_location(uri, storage_options)
    manifest = read_manifest(loc)
    index = read_index(loc, manifest)
    positions = None if features is None else feature_positions(manifest.capture.layer_ids,
                                                                features)
    return CacheReader(loc, manifest.storage.spec, units_from_index(manifest, index), index,
                       manifest, vocab_size=manifest.target.vocab_size, verify=verify,
                       check_unit=commit_check(loc, manifest.storage.spec), aux_layers=positions)
