"""The trainer's entry point: open a finalized cache through its manifest, index and commits."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sparkforge.manifests.index import INDEX_SCHEMA
from sparkforge.manifests.objects import MAX_COMMIT_BYTES, MAX_MANIFEST_BYTES, read_json
from sparkforge.manifests.schema import CacheIncompleteError, CacheManifest
from sparkforge.manifests.tables import read_tables
from sparkforge.manifests.units import UnitColumns
from sparkforge.shared import storage
from sparkforge.shared.cache_tables import SPLITS, SampleColumns, SlotColumns, TableError
from sparkforge.shared.commit_columns import CommitColumns, parse_commit_columns
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


def read_samples(loc: storage.Location, manifest: CacheManifest, *,
                 sources: bool = False) -> SampleColumns:
    """index.parquet as columns, after checking its sha256, schema and row count against the
    manifest; read twice in blocks (hash, then the needed columns), never whole in memory.

    Raises:
        ManifestError: the index is missing, unreadable or disagrees with the manifest.
    """
    key = manifest.storage.index_key
    try:
        path = storage.inside_root(loc, key)
        with loc.fs.open(path, "rb") as f:
            digest = storage.stream_sha256(f)
        if digest != manifest.storage.index_sha256:
            raise ManifestError(f"index {key}: sha256 {digest} != manifest "
                                f"storage.index_sha256 {manifest.storage.index_sha256}")
        with loc.fs.open(path, "rb") as f:
            schema = pq.read_schema(f)
            if not schema.equals(INDEX_SCHEMA):
                raise ManifestError(f"index {key}: columns {schema.names} != "
                                    f"{INDEX_SCHEMA.names}")
            f.seek(0)
            return SampleColumns.from_parquet(f, num_rows=manifest.storage.totals.samples,
                                              sources=sources)
    except FileNotFoundError as exc:
        raise ManifestError(f"{key} is missing (manifest storage.index_key); the cache cannot "
                            "be read") from exc
    except (pa.ArrowException, TableError) as exc:
        raise ManifestError(f"index {key}: {exc}") from exc


def unit_differences(units: UnitColumns, committed: CommitColumns, samples: SampleColumns,
                     slots: SlotColumns) -> list[str]:
    """How a unit as the unit and slot tables and the index describe it differs from its commit
    record, compared column by column (no object per sample)."""
    row = int(np.searchsorted(units.unit, committed.unit))
    listed = {"attempt": int(units.attempt[row]), "accounting": units.accounting(row)}
    out = [f"{name}: manifest has {want!r}, commit record {getattr(committed, name)!r}"
           for name, want in listed.items() if want != getattr(committed, name)]
    out += _slot_differences(slots, committed)
    mine = samples.of_unit(committed.unit)
    mine = mine[np.argsort(samples.sample_id[mine])]
    theirs = np.argsort(committed.samples["sample_id"])
    ids, their_ids = samples.sample_id[mine], committed.samples["sample_id"][theirs]
    out += [f"sample {sid}: in index.parquet, not in the commit record"
            for sid in np.setdiff1d(ids, their_ids)[:3].tolist()]
    out += [f"sample {sid}: in the commit record, not in index.parquet"
            for sid in np.setdiff1d(their_ids, ids)[:3].tolist()]
    if out or ids.size != their_ids.size:
        return out
    for name in ("slot", "row_offset", "length", "num_loss_tokens", "split"):
        have = getattr(samples, name)[mine]
        want = committed.samples[name][theirs]
        for i in np.flatnonzero(have != want)[:3].tolist():
            out.append(f"sample {int(ids[i])}: index.parquet has {name} = "
                       f"{_shown(name, have[i])!r}, commit record {_shown(name, want[i])!r}")
    return out


def _slot_differences(slots: SlotColumns, committed: CommitColumns) -> list[str]:
    """Which of the unit's slot columns (slot, rows, crc32c per array) differ from its record."""
    rows, order = slots.of_unit(committed.unit), np.argsort(committed.slot)
    missing = [a for a in slots.arrays if a not in committed.arrays]
    if missing:
        return [f"slots: the commit record has no crc32c for {missing}"]
    crc = committed.crc32c[:, [committed.arrays.index(a) for a in slots.arrays]]
    return [f"slots: the manifest's {name} differ from the commit record's"
            for name, theirs in (("slot", committed.slot), ("num_rows", committed.num_rows),
                                 ("crc32c", crc))
            if not np.array_equal(getattr(slots, name)[rows], theirs[order])]


def _shown(name: str, value: Any) -> object:
    return SPLITS[int(value)] if name == "split" else int(value)


@dataclass(frozen=True)
class CommitCheck:
    """A reader callback: a unit's boundaries must be the ones its commit record holds (read
    through the reader's own location, so it works in any process; plain data, so a worker
    that is not forked can unpickle it).

    Raises (from the call):
        IndexMismatchError: naming the unit and the first differences.
    """

    spec: CacheSpec
    units: UnitColumns

    def __call__(self, unit: int, reader: CacheReader[CacheManifest]) -> None:
        where, key = f"unit {unit}", commit_key(self.spec, unit)
        try:
            raw = storage.read_bytes(reader.loc, key, max_bytes=MAX_COMMIT_BYTES)
        except FileNotFoundError as exc:
            raise IndexMismatchError(f"{where}: commit record {key} is missing") from exc
        record = parse_commit_columns(raw, unit=unit, spec=self.spec)
        problems = unit_differences(self.units, record, reader.samples, reader.slots)
        if problems:
            raise IndexMismatchError(f"{where}: the index or manifest disagrees with the commit "
                                     f"record: {'; '.join(problems[:3])}; run `sparkforge "
                                     "validate`")


def open_cache(uri: str, *, storage_options: Mapping[str, Any] | None = None,
               verify: bool = True,
               features: Sequence[int] | None = None) -> CacheReader[CacheManifest]:
    """Parse and check the manifest, then return a reader over the committed units.

    Sample boundaries come from the index (read once, into columns) and are cross-checked with
    each unit's commit record when the unit is first read.

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
    samples = read_samples(loc, manifest)
    positions = None if features is None else feature_positions(manifest.capture.layer_ids,
                                                                features)
    units, slots = read_tables(loc, manifest)
    return CacheReader(loc, manifest.storage.spec, units.unit, samples, slots, manifest,
                       vocab_size=manifest.target.vocab_size, verify=verify,
                       check_unit=CommitCheck(manifest.storage.spec, units), aux_layers=positions)
