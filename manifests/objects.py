"""Find a cache's objects: the root must exist, bounded JSON reads, slot keys, sizes and times
from one listing, links out of the root."""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from sparkforge.shared import storage
from sparkforge.shared.cache_tables import SlotColumns, group_starts
from sparkforge.shared.errors import ConfigError
from sparkforge.shared.fields import load_json
from sparkforge.shared.layout import CacheSpec, slots_per_group

MAX_MANIFEST_BYTES: Final = 1 << 30
"""A manifest lists every unit's slots and checksums: ~1 KB per unit, 10^6 units fit."""
MAX_COMMIT_BYTES: Final = 256 << 20
"""A commit record holds one unit's sample rows (about 150 bytes each)."""
MAX_HEADER_BYTES: Final = 64 << 20
"""The run header; its largest part is an explicit list of eval row ids."""
MAX_PARITY_BYTES: Final = 1 << 20
"""target/parity.json: a few numbers per captured layer."""
MAX_KEY_DEPTH: Final = 8
"""Deepest object key (``aux_hidden/c/<slot>/0/0`` has 5 parts); bounds a walk through link
cycles."""


class CacheNotFoundError(ConfigError, FileNotFoundError):
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


def read_json(loc: storage.Location, key: str, *, max_bytes: int) -> object:
    """Read and decode one untrusted JSON object of at most ``max_bytes`` (bounded depth too).

    Raises:
        FileNotFoundError: the object does not exist.
        ValueError: too large, a link out of the root, not JSON, or nested too deeply; the
            message names ``key``.
    """
    return load_json(storage.read_bytes(loc, key, max_bytes=max_bytes), key)


def stored_objects(loc: storage.Location, prefix: str) -> dict[str, int]:
    """Every object under ``prefix`` (one listing): key relative to the root -> size in bytes.

    On local disk, links are followed as zarr follows them, unless they resolve outside the
    root (see :func:`escaping_links`): such objects are left out, so they count as missing.
    """
    return {key: int(info.get("size") or 0) for key, info in _listing(loc, prefix).items()}


MAX_LISTINGS_IN_FLIGHT: Final = 8
"""Arrays listed at once by validate, at most (see :func:`group_listings`)."""


def group_listings(loc: storage.Location, parent: str,
                   folders: Iterable[str]) -> Iterator[dict[str, int]]:
    """:func:`stored_objects` of each folder below ``parent`` (an array's group folders below
    its ``c``: see :func:`listing_parent`), given in the order an S3 listing brings them
    (ascending ``folder + "/"``). On S3 all of ``parent`` is one ListObjectsV2 stream, split
    into the folders as its pages come (a page per 1,000 objects, where a listing per folder
    also sent each folder's partial last page); one folder's objects and one page are held at
    a time."""
    if not storage.is_s3(loc):
        yield from (stored_objects(loc, folder) for folder in folders)
        return
    listing = storage.s3_objects(loc, parent)
    item = next(listing, None)
    for folder in folders:
        head, found = f"{folder}/", {}
        while item is not None and (item[0] < head or item[0].startswith(head)):
            if item[0].startswith(head):  # keys before it belong to no folder asked for
                found[item[0]] = int(item[1]["size"])
            item = next(listing, None)
        yield found


def slot_folders(slots: SlotColumns, spec: CacheSpec) -> Iterator[slice]:
    """Runs of ``slots`` rows whose objects share a folder: a slot group (format 3; slot ids
    rise with units), or every row (formats 1-2: one folder per array)."""
    if spec.format_version < 3:
        if len(slots):
            yield slice(0, len(slots))
        return
    _, starts = group_starts(slots.slot // slots_per_group(spec))
    for a, b in itertools.pairwise(starts.tolist()):
        yield slice(a, b)


def group_folder(name: str, key: str, spec: CacheSpec) -> str:
    """The folder listed for ``key``'s group: ``<array>/c/<group>`` (format 3), else the array."""
    return "/".join(key.split("/")[:3]) if spec.format_version >= 3 else name


def listing_parent(name: str, spec: CacheSpec) -> str:
    """The folder holding every :func:`group_folder` of array ``name``: its ``c`` (format 3),
    else the array."""
    return f"{name}/c" if spec.format_version >= 3 else name


def object_times(loc: storage.Location, prefix: str) -> dict[str, float | None]:
    """Every object under ``prefix`` (one listing): key -> last-modified time (Unix seconds).

    The time is the store's own (S3 ``LastModified``, file mtime), so workers' clocks do not
    matter; None where the filesystem reports no time. Local links as in :func:`stored_objects`.
    """
    return {key: _modified(info) for key, info in _listing(loc, prefix).items()}


def _listing(loc: storage.Location, prefix: str) -> dict[str, dict[str, Any]]:
    """Key relative to the root -> the filesystem's details (size, time) of one object."""
    path = loc.path(prefix)
    if loc.is_local:
        return _local_objects(loc.root, path)
    try:
        if storage.is_s3(loc):
            return dict(storage.s3_objects(loc, prefix))
        loc.fs.invalidate_cache(path)
        found = loc.fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    finally:
        loc.fs.invalidate_cache(path)  # fsspec keeps listings: drop this one's
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


def _local_objects(root: str, path: str) -> dict[str, dict[str, Any]]:
    """Files under ``path`` (links followed as zarr follows them, unless they leave ``root``)."""
    return dict(_local_files(root, path))


def _local_files(root: str, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(key, size and time) of each file under ``path``, one folder listed at a time."""
    start = len(Path(path).relative_to(root).parts)
    if not storage.resolves_inside(path, root):
        return
    stack = [(path, start)]
    while stack:
        here, depth = stack.pop()
        if depth > MAX_KEY_DEPTH:  # a link cycle
            continue
        for entry in _entries(here):
            # Only a link can lead out of the root: its folder was checked on the way down.
            if entry.is_symlink() and not storage.resolves_inside(entry.path, root):
                continue
            if entry.is_dir():
                stack.append((entry.path, depth + 1))
            elif entry.is_file():
                info = entry.stat()
                yield entry.path[len(root) + 1:], {"size": info.st_size, "mtime": info.st_mtime}


def object_totals(loc: storage.Location, spec: CacheSpec,
                  prefix: str | None = None) -> tuple[int, int]:
    """Objects under ``prefix`` (None: the whole cache) and their bytes, as
    :func:`stored_objects` lists them, one folder at a time (fsspec's ``find`` of the root held
    every object's details at once, ~1 KB each): on an object store, no listing goes past one
    group folder (:func:`_remote_files`)."""
    start = loc.root if prefix is None else loc.path(prefix)
    found = (_local_files(loc.root, start) if loc.is_local
             else _remote_files(loc, "" if prefix is None else prefix, spec))
    count = total = 0
    for _, info in found:
        count += 1
        total += int(info.get("size") or 0)
    return count, total


def _listed_whole(key: str, spec: CacheSpec) -> bool:
    """Whether the folder ``key`` is listed in one recursive listing: from the third level on
    (a group folder: ``_commits/<g>``, ``_attempts/<g>``, ``<array>/c/<g>``), but an array's
    ``c/`` of format 3 on, whose entries are the groups."""
    parts = key.split("/") if key else []
    return len(parts) >= 2 and not (len(parts) == 2 and parts[1] == "c"
                                    and spec.format_version >= 3)


def _remote_files(loc: storage.Location, prefix: str,
                  spec: CacheSpec) -> Iterator[tuple[str, dict[str, Any]]]:
    """(key, details) of each object under ``prefix`` on an object store: the top folders are
    listed one level at a time (S3's delimiter listing, a page per 1,000 entries) and each
    folder below them (a group's, see :func:`_listed_whole`) in one recursive listing, so one
    listing holds at most one group's objects."""
    stack = [prefix]
    while stack:
        key = stack.pop()
        if _listed_whole(key, spec):
            yield from _listing(loc, key).items()
            continue
        path = loc.path(key) if key else loc.root
        loc.fs.invalidate_cache(path)
        try:
            listing = loc.fs.ls(path, detail=True)
        except FileNotFoundError:
            continue
        finally:
            loc.fs.invalidate_cache(path)  # s3fs keeps listings: drop this one's
        for info in listing:
            name = str(info["name"]).rstrip("/")[len(loc.root) + 1:]
            if info.get("type") == "directory":
                stack.append(name)
            else:
                yield name, info


def _entries(folder: str) -> list[os.DirEntry[str]]:
    """A folder's entries (none if it vanished or cannot be listed)."""
    try:
        with os.scandir(folder) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def escaping_links(loc: storage.Location) -> dict[str, str]:
    """Links under a local cache root that resolve outside it: key -> where they point.

    A cache holds its own objects; a link out of it could make readers quote or train on files
    the commit records do not describe (e.g. ``/etc/passwd``). Empty for object stores.
    """
    return {key: os.path.realpath(entry.path) for key, entry in _local_entries(loc)
            if entry.is_symlink() and not storage.resolves_inside(entry.path, loc.root)}


def irregular_objects(loc: storage.Location) -> dict[str, str]:
    """Entries under a local cache root that are FIFOs, devices or sockets: key -> what they are.

    Opening one can block forever (a FIFO waits for a writer) or read without end (a device), so
    they are named and never opened. Empty for object stores.
    """
    out = {}
    for key, entry in _local_entries(loc):
        try:
            mode = entry.stat().st_mode
        except OSError:  # a dangling link: missing, as its key reports
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            out[key] = storage.file_kind(mode)
    return out


def _local_entries(loc: storage.Location) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """(key, entry) of every file and folder under a local root; links to folders not descended."""
    if not loc.is_local:
        return
    stack = [loc.root]
    while stack:
        for entry in _entries(stack.pop()):
            yield entry.path[len(loc.root) + 1:], entry
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
