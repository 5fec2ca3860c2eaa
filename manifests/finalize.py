"""Finalize a cache: from the commit records alone, write index.parquet, then manifest.json last."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from sparkforge.manifests.commits import parse_commit_bytes
from sparkforge.manifests.fields import ManifestError
from sparkforge.manifests.header import parse_header, parse_spec
from sparkforge.manifests.objects import (
    MAX_COMMIT_BYTES,
    MAX_HEADER_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_PARITY_BYTES,
    read_json,
)
from sparkforge.manifests.schema import (
    FORMAT_VERSION,
    CacheIncompleteError,
    CacheManifest,
    parse_format_version,
)
from sparkforge.shared import storage
from sparkforge.shared.commit import UnitInfo
from sparkforge.shared.layout import (
    HEADER_KEY,
    INDEX_KEY,
    MANIFEST_KEY,
    PARITY_FILE,
    TARGET_PREFIX,
    CacheSpec,
    array_layouts,
    commit_key,
)
from sparkforge.shared.provenance import git_sha, package_version

logger = logging.getLogger(__name__)

INDEX_SCHEMA = pa.schema([
    ("sample_id", pa.int64()), ("unit", pa.int64()), ("slot", pa.int64()),
    ("row_offset", pa.int64()), ("length", pa.int32()), ("num_loss_tokens", pa.int32()),
    ("source_row", pa.int64()), ("source_hash", pa.string()), ("split", pa.string()),
])


def read_run_header(loc: storage.Location) -> tuple[CacheSpec, dict[str, Any]]:
    """The spec and the raw (validated) producer header stored at creation."""
    try:
        data = read_json(loc, HEADER_KEY, max_bytes=MAX_HEADER_BYTES)
    except FileNotFoundError as exc:
        raise CacheIncompleteError(f"{loc.uri} has no {HEADER_KEY}: not a sparkforge cache")\
            from exc
    if not isinstance(data, dict) or set(data) != {"format_version", "spec", "header"}:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ManifestError(f"{loc.uri}/{HEADER_KEY}: expected exactly the keys "
                            f"['format_version', 'header', 'spec'], got {got}")
    parse_format_version(data["format_version"])
    parse_header(data["header"])
    return parse_spec(data["spec"], "spec"), data["header"]


def finalize_run(uri: str, *, storage_options: Mapping[str, Any] | None = None) -> CacheManifest:
    """``sparkforge finalize``: :func:`finalize_cache` with the unit count from the run header.

    Raises:
        CacheIncompleteError: listing the missing units.
    """
    _, header = read_run_header(storage.open_location(uri, storage_options))
    expected: int = header["producer_config"]["resolved"]["num_units"]
    return finalize_cache(uri, expected_units=expected, storage_options=storage_options)


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
    committed = {int(n[5:13]) for n in storage.list_names(loc, "_commits")
                 if n.startswith("unit_") and n.endswith(".json") and n[5:13].isdigit()}
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
    index = _index_bytes(units)
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


def _index_bytes(units: Sequence[UnitInfo]) -> bytes:
    rows = sorted((s for u in units for s in u.samples), key=lambda s: s.sample_id)
    unit_of = {s.sample_id: u.unit for u in units for s in u.samples}
    columns = {name: [getattr(s, name) for s in rows] for name in INDEX_SCHEMA.names
               if name != "unit"}
    columns["unit"] = [unit_of[s.sample_id] for s in rows]
    table = pa.table({n: columns[n] for n in INDEX_SCHEMA.names}, schema=INDEX_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=256 * 1024)
    return buf.getvalue()


def _codec_names(spec: CacheSpec) -> dict[str, str]:
    return {name: ("sharded blosc zstd-1 " + ("noshuffle" if a.dtype.itemsize == 1 else
                                              "shuffle")) if a.blosc else "zstd-3"
            for name, a in array_layouts(spec).items()}


def _manifest_json(loc: storage.Location, spec: CacheSpec, header: dict[str, Any],
                   units: Sequence[UnitInfo], index: bytes) -> dict[str, Any]:
    layouts = array_layouts(spec)
    tokens = sum(u.num_tokens for u in units)
    row_bytes = sum(a.dtype.itemsize * math.prod(a.row_shape) for a in layouts.values())
    acc = [u.accounting for u in units]
    skipped: Counter[str] = Counter()
    for a in acc:
        skipped.update(a.skipped)
    return {
        "format_version": FORMAT_VERSION, "complete": True,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "sparkforge_version": package_version("sparkforge") or "0+unknown", "git_sha": git_sha(),
        **header,
        "accounting": {"input_rows": sum(a.input_rows for a in acc),
                       "written": sum(a.written for a in acc), "skipped": dict(skipped),
                       "failed": sum(a.failed for a in acc)},
        "storage": {
            "spec": spec.to_json(),
            "arrays": {n: {"dtype": str(a.dtype), "dtype_logical": a.dtype_logical,
                           "row_shape": list(a.row_shape)} for n, a in layouts.items()},
            "codecs": _codec_names(spec),
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
