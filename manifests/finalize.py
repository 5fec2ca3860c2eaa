"""Finalize a cache: from the commit records alone, write index.parquet, then manifest.json last."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sparkforge.manifests.index import index_bytes
from sparkforge.manifests.objects import (
    MAX_COMMIT_BYTES,
    MAX_HEADER_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_PARITY_BYTES,
    read_json,
)
from sparkforge.manifests.schema import (
    CacheIncompleteError,
    CacheManifest,
    parse_format_version,
)
from sparkforge.shared import storage
from sparkforge.shared.commit import (
    UnitInfo,
    accounting_json,
    committed_units,
    parse_commit_bytes,
)
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
    commit_key,
    compressor,
    describe_codecs,
    parse_spec,
)
from sparkforge.shared.provenance import git_sha, package_version
from sparkforge.shared.records import sum_accounting

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


def finalize_run(uri: str, *, storage_options: Mapping[str, Any] | None = None) -> CacheManifest:
    """``sparkforge finalize``: :func:`finalize_cache` with the unit count from the run header.

    Raises:
        CacheIncompleteError: listing the missing units.
    """
    _, header = read_run_header(storage.open_location(uri, storage_options))
    return finalize_cache(uri, expected_units=header.num_units, storage_options=storage_options)


def finalize_cache(uri: str, *, expected_units: int,
                   storage_options: Mapping[str, Any] | None = None) -> CacheManifest:
    """Write index.parquet and manifest.json (complete) once every unit is committed.

    Idempotent: an existing complete manifest over the same units is returned unchanged.

    Raises:
        CacheIncompleteError: listing the missing units.
        ManifestError: if a commit record is malformed or sample ids repeat across units.
    """
    loc = storage.open_location(uri, storage_options)
    spec, header = read_run_header(loc)
    committed = committed_units(loc)
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
        if existing.complete and len(existing.storage.units) == expected_units:
            return existing
    units = [parse_commit_bytes(storage.read_bytes(loc, commit_key(u), max_bytes=MAX_COMMIT_BYTES),
                                unit=u, spec=spec) for u in range(expected_units)]
    _check_unique(units)
    index = index_bytes(units)
    storage.atomic_write(loc, INDEX_KEY, index)
    manifest = CacheManifest.from_json(_manifest_json(loc, spec, header, units, index))
    storage.atomic_write(loc, MANIFEST_KEY, json.dumps(manifest.to_json(), indent=1).encode())
    logger.info("finalized %s: %d units, %d samples, %d tokens", uri, len(units),
                manifest.storage.totals.samples, manifest.storage.totals.tokens)
    return manifest


def _check_unique(units: Sequence[UnitInfo]) -> None:
    owners = Counter(s.sample_id for u in units for s in u.samples)
    dups = sorted(sid for sid, n in owners.items() if n > 1)
    if dups:
        where = {sid: [u.unit for u in units for s in u.samples if s.sample_id == sid]
                 for sid in dups[:5]}
        raise ManifestError(f"{len(dups)} sample ids appear in more than one unit, e.g. "
                            + "; ".join(f"sample {k} in units {v}" for k, v in where.items()))


def _manifest_json(loc: storage.Location, spec: CacheSpec, header: RunHeader,
                   units: Sequence[UnitInfo], index: bytes) -> dict[str, Any]:
    layouts = array_layouts(spec)
    tokens = sum(u.num_tokens for u in units)
    row_bytes = sum(a.dtype.itemsize * math.prod(a.row_shape) for a in layouts.values())
    return {
        "format_version": spec.format_version, "complete": True,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "sparkforge_version": package_version("sparkforge") or "0+unknown", "git_sha": git_sha(),
        **header.to_json(),
        "accounting": accounting_json(sum_accounting([u.accounting for u in units])),
        "storage": {
            "spec": spec.to_json(),
            "arrays": {n: {"dtype": str(a.dtype), "dtype_logical": a.dtype_logical,
                           "row_shape": list(a.row_shape)} for n, a in layouts.items()},
            "codecs": {n: describe_codecs([compressor(a, spec)], sharded=a.blosc)
                       for n, a in layouts.items()},
            "units": [{"unit": u.unit, "attempt": u.attempt,
                       "slots": u.to_json()["slots"], "num_samples": len(u.samples),
                       "num_tokens": u.num_tokens, "accounting": u.to_json()["accounting"]}
                      for u in units],
            "index_key": INDEX_KEY, "index_sha256": hashlib.sha256(index).hexdigest(),
            "totals": {"samples": sum(len(u.samples) for u in units), "tokens": tokens,
                       "logical_bytes": tokens * row_bytes,
                       "stored_bytes": int(loc.fs.du(loc.root, total=True))},
        },
        "parity": _parity_report(loc),
    }


def _parity_report(loc: storage.Location) -> Any:
    """The producer's parity report (``target/parity.json``), or None when none was run."""
    key = f"{TARGET_PREFIX}/{PARITY_FILE}"
    return read_json(loc, key, max_bytes=MAX_PARITY_BYTES) if storage.exists(loc, key) else None
