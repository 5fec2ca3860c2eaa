"""Find a cache's objects: the root must exist, each slot's object key, sizes from one listing."""

from __future__ import annotations

from collections.abc import Mapping
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
    path = loc.path(prefix)
    loc.fs.invalidate_cache(path)
    try:
        found = loc.fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    return {str(p)[len(loc.root) + 1:]: int(info.get("size") or 0) for p, info in found.items()}


def slot_key(name: str, arr: zarr.Array[Any], slot: int) -> str:
    """The store key of one slot's object (a shard, or the one chunk of an unsharded array)."""
    return f"{name}/{arr.metadata.encode_chunk_key((slot, *[0] * (arr.ndim - 1)))}"
