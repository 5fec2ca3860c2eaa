"""Find a cache's objects: the root must exist, each slot's object key, sizes and times from one
listing."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

import zarr

from sparkforge.shared import storage


class CacheNotFoundError(FileNotFoundError, ValueError):
    """Raised when the cache URI names nothing at all (a usage error, not an invalid cache)."""


def existing_location(uri: str, storage_options: Mapping[str, Any] | None) -> storage.Location:
    """The cache's location, checked to exist.

    Raises:
        CacheNotFoundError: if nothing exists at ``uri``.
    """
    loc = storage.open_location(uri, storage_options)
    loc.fs.invalidate_cache(loc.root)
    if not loc.fs.exists(loc.root):
        raise CacheNotFoundError(f"no cache at {uri}: the path does not exist")
    return loc


def stored_objects(loc: storage.Location, prefix: str) -> dict[str, int]:
    """Every object under ``prefix`` (one listing): key relative to the root -> size in bytes."""
    return {key: int(info.get("size") or 0) for key, info in _listing(loc, prefix).items()}


def object_times(loc: storage.Location, prefix: str) -> dict[str, float | None]:
    """Every object under ``prefix`` (one listing): key -> last-modified time (Unix seconds).

    The time is the store's own (S3 ``LastModified``, file mtime), so workers' clocks do not
    matter; None where the filesystem reports no time.
    """
    return {key: _modified(info) for key, info in _listing(loc, prefix).items()}


def _listing(loc: storage.Location, prefix: str) -> dict[str, dict[str, Any]]:
    path = loc.path(prefix)
    loc.fs.invalidate_cache(path)
    try:
        found = loc.fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    return {str(p)[len(loc.root) + 1:]: info for p, info in found.items()}


# Local and GCS report "mtime", S3 "LastModified", the memory filesystem only "created".
_TIME_FIELDS = ("mtime", "LastModified", "updated", "created")


def _modified(info: Mapping[str, Any]) -> float | None:
    for name in _TIME_FIELDS:
        value = info.get(name)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value).timestamp()
            except ValueError:
                continue
    return None


def slot_key(name: str, arr: zarr.Array[Any], slot: int) -> str:
    """The store key of one slot's object (a shard, or the one chunk of an unsharded array)."""
    return f"{name}/{arr.metadata.encode_chunk_key((slot, *[0] * (arr.ndim - 1)))}"
