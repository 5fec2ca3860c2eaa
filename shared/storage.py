"""Open any fsspec URI as a cache location: zarr store, safe keys, atomic and exclusive files."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import re
import stat
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, BinaryIO, Final, TypeVar

import fsspec
import zarr
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem
from zarr.abc.store import Store
from zarr.storage import FsspecStore, LocalStore

from sparkforge.shared.errors import SparkforgeError

logger = logging.getLogger(__name__)
_SAFE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_PARTIAL = re.compile(r"\.[0-9a-f]{32}\.partial$")
T = TypeVar("T")
R = TypeVar("R")
HASH_BLOCK_BYTES: Final = 8 << 20
"""How much :func:`stream_sha256` reads at a time."""


class UnsafeKeyError(SparkforgeError):
    """Raised when a key read from untrusted data would escape the cache root."""


class IrregularObjectError(SparkforgeError):
    """Raised when a local cache object is a FIFO, device, socket or folder: opening one can block
    forever or stream without end, so it is named and never opened."""


class ObjectTooLargeError(SparkforgeError):
    """Raised when an object is larger than its reader allows (a corrupt or hostile cache)."""


def safe_key(key: str) -> str:
    """Return ``key`` if it is a plain relative key inside the cache root, else raise.

    Allowed: '/'-separated parts of letters, digits, '.', '_', '-', not starting with '.' or '-'
    (so no '..', no absolute paths, no backslashes, no empty parts).

    Raises:
        UnsafeKeyError: if any part is unsafe.
    """
    if not isinstance(key, str) or not key:
        raise UnsafeKeyError(f"cache key must be a non-empty string, got {key!r}")
    for part in key.split("/"):
        if not _SAFE_PART.match(part):
            raise UnsafeKeyError(
                f"cache key {key!r} escapes the cache root or has an unsafe part {part!r}"
            )
    return key


@dataclass(frozen=True)
class Location:
    """A cache root: the fsspec filesystem, the root path inside it and the original URI."""

    uri: str
    fs: fsspec.AbstractFileSystem
    root: str
    storage_options: Mapping[str, Any]

    @property
    def is_local(self) -> bool:
        """True for local paths and file:// URIs (atomicity then comes from link/rename)."""
        return isinstance(self.fs, LocalFileSystem)

    def path(self, key: str) -> str:
        """The filesystem path of a checked key under the root."""
        return f"{self.root}/{safe_key(key)}"


S3_POOL_CONNECTIONS: Final = 128
"""HTTP connections one S3 filesystem may hold open, unless ``storage_options`` set
``config_kwargs.max_pool_connections``: botocore's default of 10 caps reads in flight at 10."""


def open_location(uri: str, storage_options: Mapping[str, Any] | None = None) -> Location:
    """Resolve a local path or ``file://``, ``s3://``, ``gs://``, ``memory://`` URI."""
    options = dict(storage_options or {})
    on_s3 = fsspec.core.split_protocol(uri)[0] in ("s3", "s3a")
    if on_s3:
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("max_pool_connections", S3_POOL_CONNECTIONS)
        options["config_kwargs"] = config
    fs, root = fsspec.core.url_to_fs(uri, **options)
    if on_s3:
        _cheaper_responses(fs)
    return Location(uri=uri, fs=fs, root=str(root).rstrip("/"), storage_options=options)


def is_s3(loc: Location) -> bool:
    """Whether the location is on S3 (s3fs)."""
    return fsspec.core.split_protocol(loc.uri)[0] in ("s3", "s3a")


def s3_objects(loc: Location, prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object under ``prefix`` on S3 as ListObjectsV2 pages bring them: (key relative to
    the root, ``{"size", "mtime"}``, the time a datetime). fsspec's ``find`` also builds and
    caches a listing of every folder below ``prefix`` (a fifth of a group folder's listing
    CPU); the objects' times are parsed cheaply and each page once (:func:`_cheaper_responses`)."""
    fs = loc.fs
    bucket, key, _ = fs.split_path(loc.path(prefix))
    request, skip = {"Bucket": bucket, "Prefix": f"{key}/"}, len(loc.root) + 1
    while True:
        page = fs.call_s3("list_objects_v2", **request)
        for obj in page.get("Contents", ()):
            name = f"{bucket}/{obj['Key']}"
            if not name.endswith("/"):  # a folder marker, no object
                yield name[skip:], {"size": obj["Size"], "mtime": obj["LastModified"]}
        if not page.get("IsTruncated"):
            return
        request["ContinuationToken"] = page["NextContinuationToken"]


def _cheaper_responses(fs: Any) -> None:
    """Have an s3fs filesystem's botocore client parse times with :func:`_parse_timestamp` and
    check listing pages with :func:`_check_200_error`.

    botocore's endpoint makes a parser for each response from the session's parser factory, so
    the factory's default is set on the session: s3fs's own, or, before s3fs first connects, the
    one it would make (``AioSession(**fs.kwargs)``, as its ``set_session`` does). A client copies
    the session's handlers when it is made, so a client s3fs already made gets the check too."""
    from botocore.handlers import _handle_200_error

    if fs.session is None:
        from aiobotocore.session import AioSession

        fs.session = AioSession(**fs.kwargs)
    fs.session.get_component("response_parser_factory").set_parser_defaults(
        timestamp_parser=_parse_timestamp)
    client = getattr(fs, "_s3", None)
    for events in (fs.session.get_component("event_emitter"),
                   *([client.meta.events] if client is not None else [])):
        events.unregister(_BEFORE_PARSE, _handle_200_error)
        events.register_first(_BEFORE_PARSE, _check_200_error, unique_id=_check_200_error.__name__)


_BEFORE_PARSE: Final = "before-parse.s3.*"
_LISTING_END: Final = b"</ListBucketResult>"


def _check_200_error(operation_model: Any, response_dict: Any, **kwargs: Any) -> None:
    """botocore's check for an error inside an S3 answer of status 200 (it parses the body with
    ElementTree before the response parser parses it again: a quarter to a half of a listing
    page's CPU), skipped for a listing page that ends as a whole page does. An error S3 sends
    with a 200 is an ``<Error>`` document and a page the network cut off lacks its closing tag,
    so both still go to botocore's check, which makes them a 500 that botocore retries."""
    from botocore.handlers import _handle_200_error

    if (operation_model.name == "ListObjectsV2" and response_dict
            and response_dict.get("status_code") == 200
            and (response_dict.get("body") or b"").rstrip().endswith(_LISTING_END)):
        return
    _handle_200_error(operation_model, response_dict, **kwargs)


def _parse_timestamp(value: Any) -> datetime:
    """botocore's timestamp parser, cheaper, the same instants: ISO 8601 text with a time zone
    (every listed object's ``LastModified``) by ``datetime.fromisoformat`` (0.1 us where
    dateutil takes about 40), HTTP dates with a zone (the ``Last-Modified`` header of every GET)
    by ``email.utils`` (3 us against 64), anything else (numbers, times without a zone) by
    botocore's own parser."""
    if isinstance(value, str):
        parsed = _iso_or_http_date(value)
        if parsed is not None and parsed.tzinfo is not None:
            return parsed
    from botocore.utils import parse_timestamp

    return parse_timestamp(value)  # type: ignore[no-any-return]


def _iso_or_http_date(value: str) -> datetime | None:
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        pass
    try:
        return parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None


def zarr_store(loc: Location, *, read_only: bool) -> Store:
    """The zarr v3 store of the location (LocalStore on disk, FsspecStore elsewhere)."""
    if loc.is_local:
        Path(loc.root).mkdir(parents=True, exist_ok=True)
        return LocalStore(loc.root, read_only=read_only)
    store = FsspecStore.from_url(loc.uri, storage_options=dict(loc.storage_options),
                                 read_only=read_only)
    if is_s3(loc):  # its own filesystem: the asynchronous one
        _cheaper_responses(store.fs)
    return store


def exclusive_create(loc: Location, key: str, data: bytes) -> None:
    """Create ``key`` with ``data`` only if it does not exist yet; durable once this returns.

    Local: temp file + fsync + ``os.link`` (fails atomically if the target exists) + directory
    fsync. Object stores: one PUT with ``If-None-Match: *`` (``pipe_file(mode="create")``).

    Raises:
        FileExistsError: if ``key`` already exists; the existing object is untouched.
    """
    path = loc.path(key)
    if not loc.is_local:
        loc.fs.pipe_file(path, data, mode="create")
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temp(target, data)
    try:
        os.link(tmp, target)
    finally:
        tmp.unlink()
    _fsync_dir(target.parent)


def atomic_write(loc: Location, key: str, data: bytes, *, sync: bool = True) -> None:
    """Write ``key`` whole or not at all, replacing any previous version.

    On local disk the file and its folder are fsynced unless ``sync`` is False (then, as zarr's
    own local store writes, a killed process leaves it whole or absent, but a power loss may
    lose it).
    """
    path = loc.path(key)
    if not loc.is_local:
        loc.fs.pipe_file(path, data)
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temp(target, data, sync=sync)
    tmp.replace(target)
    if sync:
        _fsync_dir(target.parent)


@contextmanager
def staged_file(loc: Location, key: str) -> Iterator[Path]:
    """A local file to write ``key`` into, published whole when the block exits cleanly (local:
    fsynced and renamed into place; elsewhere: uploaded) and removed when it raises, so an object
    too large to hold in memory is still written whole or not at all."""
    target = Path(loc.path(key)) if loc.is_local else None
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
    else:
        tmp = Path(tempfile.gettempdir(), f"sparkforge.{uuid.uuid4().hex}.partial")
    try:
        yield tmp
        if target is None:
            loc.fs.put_file(str(tmp), loc.path(key))
        else:
            with tmp.open("rb+") as f:
                os.fsync(f.fileno())
            tmp.replace(target)
            _fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)


def stream_sha256(f: BinaryIO, copy_to: BinaryIO | None = None) -> str:
    """The sha256 of what is left to read in ``f``, read 8 MiB at a time (each block also
    written to ``copy_to`` when given)."""
    digest = hashlib.sha256()
    while block := f.read(HASH_BLOCK_BYTES):
        digest.update(block)
        if copy_to is not None:
            copy_to.write(block)
    return digest.hexdigest()


def read_bytes(loc: Location, key: str, *, max_bytes: int | None = None) -> bytes:
    """Read one whole object of at most ``max_bytes`` (FileNotFoundError if absent).

    Raises:
        ObjectTooLargeError: the object holds more than ``max_bytes`` bytes.
        UnsafeKeyError: on local disk, ``key`` is a link resolving outside the cache root.
    """
    path = inside_root(loc, key)
    # One ranged GET from byte 0: at most max_bytes + 1 bytes come back, so a huge object is never
    # loaded, and s3fs sends no HEAD first (it asks an object's size before an unranged read).
    try:
        data = loc.fs.cat_file(path, start=0, end=_read_end(max_bytes))
    except OSError:
        # S3 refuses any range of an empty object (416, not satisfiable): only then, ask its size.
        if loc.is_local or loc.fs.size(path) != 0:
            raise
        data = b""
    return _within(key, data, max_bytes)


async def _read_bytes_async(loc: Location, key: str, max_bytes: int | None) -> bytes:
    """:func:`read_bytes` on an asynchronous filesystem's own loop (never local disk)."""
    path = loc.path(key)
    try:
        data = await loc.fs._cat_file(path, start=0, end=_read_end(max_bytes))
    except OSError:
        if await loc.fs._size(path) != 0:
            raise
        data = b""
    return _within(key, data, max_bytes)


def _read_end(max_bytes: int | None) -> int | None:
    return None if max_bytes is None else max_bytes + 1


def _within(key: str, data: object, max_bytes: int | None) -> bytes:
    assert isinstance(data, bytes)
    if max_bytes is not None and len(data) > max_bytes:
        raise ObjectTooLargeError(f"{key}: larger than the {max_bytes:,} bytes allowed; refusing "
                                  "to read it")
    return data


DEFAULT_MAX_CONCURRENCY: Final = 32
"""Reads in flight at once by default: object stores answer each in tens of milliseconds, so
throughput comes from many at once (local disk is served as fast either way)."""

ReadResult = bytes | OSError | ValueError


def read_many(loc: Location, keys: Iterable[str], *, max_bytes: int | None = None,
              max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
              ) -> Iterator[tuple[str, ReadResult]]:
    """Read objects as :func:`read_bytes` does, up to ``max_concurrency`` at once, in key order.

    Each key comes back with its bytes, or with the error reading it raised (a missing object's
    ``FileNotFoundError``, an unsafe or oversized one's ``ValueError``), so one bad object stops
    nothing. The keys go out in batches of ``max_concurrency`` (:func:`read_batches`), the next
    sent while the one before is handed out: at most ``2 * max_concurrency`` objects are held
    ahead of the consumer.
    """
    size = max(1, max_concurrency)
    with read_batches(loc, max_concurrency=size, max_bytes=max_bytes) as send:
        for chunk, results in _in_order(send, _batches(keys, size), ahead=2):
            yield from zip(chunk, results, strict=True)


@contextmanager
def read_batches(loc: Location, *, max_concurrency: int, max_bytes: int | None = None,
                 ) -> Iterator[Callable[[list[str]], Future[list[ReadResult]]]]:
    """``send(keys)``: a future of the keys' :func:`read_bytes` results (bytes or the error),
    with at most ``max_concurrency`` reads in flight across all batches sent.

    On an asynchronous filesystem (S3, GCS) a batch is one coroutine on the filesystem's own
    loop: a thread per read, each waiting on that loop, costs the client about a fifth more CPU
    per GET (S3: ``benchmarks/bench_s3_client.py``). Elsewhere the reads go to a thread pool.
    """
    if isinstance(loc.fs, AsyncFileSystem):
        gate = asyncio.Semaphore(max(1, max_concurrency))

        async def read(key: str) -> ReadResult:
            async with gate:
                try:
                    return await _read_bytes_async(loc, key, max_bytes)
                except (OSError, ValueError) as exc:
                    return exc

        async def batch(keys: list[str]) -> list[ReadResult]:
            return await asyncio.gather(*(read(key) for key in keys))

        yield lambda keys: asyncio.run_coroutine_threadsafe(batch(keys), loc.fs.loop)
        return

    def read_one(key: str) -> ReadResult:
        try:
            return read_bytes(loc, key, max_bytes=max_bytes)
        except (OSError, ValueError) as exc:
            return exc

    with ThreadPoolExecutor(max(1, max_concurrency), thread_name_prefix="read") as pool:
        yield lambda keys: _all_of([pool.submit(read_one, key) for key in keys])


def _all_of(futures: list[Future[R]]) -> Future[list[R]]:
    """One future of the results of ``futures``, in their order, once all are done; cancelling
    it (a consumer that stopped) cancels those not started and drops the results."""
    combined: Future[list[R]] = Future()
    left = len(futures)
    lock = threading.Lock()

    def one_done(_: Future[R]) -> None:
        nonlocal left
        with lock:
            left -= 1
            if left:
                return
        with suppress(CancelledError, InvalidStateError):  # cancelled: the consumer stopped
            errors = [e for f in futures if (e := f.exception()) is not None]
            if errors:  # a read raised what read_one does not catch
                combined.set_exception(errors[0])
            else:
                combined.set_result([f.result() for f in futures])
        futures.clear()  # the parts' callbacks and this closure: no cycle keeps the bytes alive

    def cancel_parts(done: Future[list[R]]) -> None:
        if done.cancelled():
            for future in futures:
                future.cancel()

    combined.add_done_callback(cancel_parts)
    if not futures:
        combined.set_result([])
    for future in futures:
        future.add_done_callback(one_done)
    return combined


def _batches(items: Iterable[T], size: int) -> Iterator[list[T]]:
    it = iter(items)
    while batch := list(itertools.islice(it, size)):
        yield batch


def map_ahead(fn: Callable[[T], R], items: Iterable[T], *, max_concurrency: int,
              name: str) -> Iterator[tuple[T, R]]:
    """``(item, fn(item))`` for each item, in order, up to ``max_concurrency`` calls at once
    (threads named ``name``); at most ``2 * max_concurrency`` results are held ahead."""
    with ThreadPoolExecutor(max(1, max_concurrency), thread_name_prefix=name) as pool:
        yield from _in_order(lambda item: pool.submit(fn, item), items,
                             ahead=2 * max_concurrency)


def _in_order(submit: Callable[[T], Future[R]], items: Iterable[T], *,
              ahead: int) -> Iterator[tuple[T, R]]:
    """``(item, result)`` for each item, in order, with at most ``ahead`` items submitted and
    not yet handed out; those left when the consumer stops are cancelled."""
    pending: deque[tuple[T, Future[R]]] = deque()
    try:
        for item in items:
            pending.append((item, submit(item)))
            if len(pending) >= ahead:
                item, future = pending.popleft()
                yield item, future.result()
        while pending:
            item, future = pending.popleft()
            yield item, future.result()
    finally:
        for _, future in pending:
            future.cancel()


class PendingWrites:
    """Atomic writes (:func:`atomic_write`, with its ``sync``) sent on a thread pool while the
    caller goes on.

    At most ``max_in_flight`` of them, holding at most ``max_bytes`` (always at least one), are
    pending at once; a second write of a key waits for the first, so the last one given wins.
    :meth:`wait` returns once every write has ended.
    """

    def __init__(self, loc: Location, pool: ThreadPoolExecutor, *, max_in_flight: int,
                 max_bytes: int, sync: bool = True) -> None:
        self._loc, self._pool, self._sync = loc, pool, sync
        self._max_in_flight, self._max_bytes = max(1, max_in_flight), max_bytes
        self._pending: dict[str, tuple[Future[None], int]] = {}
        self._bytes = 0

    def write(self, key: str, data: bytes) -> None:
        """Send ``data`` to ``key``; first waits for ``key``'s earlier write, then for the oldest
        writes while the bounds are reached (raising the error of any that failed)."""
        if key in self._pending:
            self._finish(key)
        while self._pending and (len(self._pending) >= self._max_in_flight
                                 or self._bytes + len(data) > self._max_bytes):
            self._finish(next(iter(self._pending)))
        future = self._pool.submit(atomic_write, self._loc, key, data, sync=self._sync)
        self._pending[key] = (future, len(data))
        self._bytes += len(data)

    def wait(self) -> None:
        """Block until every write sent has ended; raise the first failure, once all have."""
        errors = []
        while self._pending:
            try:
                self._finish(next(iter(self._pending)))
            except Exception as exc:  # noqa: BLE001 (re-raised below, after the others end)
                errors.append(exc)
        if errors:
            raise errors[0]

    def _finish(self, key: str) -> None:
        future, size = self._pending.pop(key)
        self._bytes -= size
        future.result()


def inside_root(loc: Location, key: str) -> str:
    """The path of ``key``, checked before any local read: on local disk it must not resolve
    (through links) outside the root, and if it exists it must be a regular file.

    Raises:
        UnsafeKeyError: the path resolves outside the cache root.
        IrregularObjectError: the path is a FIFO, device, socket or folder.
    """
    path = loc.path(key)
    if loc.is_local:
        if not resolves_inside(path, loc.root):
            raise UnsafeKeyError(f"{key}: a link to {os.path.realpath(path)}, outside the cache "
                                 f"root {loc.root}; refusing to read it")
        check_regular(path, key)
    return path


def check_regular(path: str | Path, name: object) -> None:
    """Refuse a local ``path`` that exists but is no regular file (``stat`` never blocks, where
    ``open`` on a FIFO waits for a writer forever); a missing one is left to the caller."""
    try:
        mode = Path(path).stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if not stat.S_ISREG(mode):
        raise IrregularObjectError(f"{name}: {file_kind(mode)}, not a regular file; refusing to "
                                   "open it (replace it with the real file)")


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    kinds = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISDIR, "a folder"))
    return next((kind for test, kind in kinds if test(mode)), "a special file")


def check_zarr_metadata(loc: Location, names: Iterable[str]) -> None:
    """Check the group's and each named array's ``zarr.json`` as :func:`inside_root` does, before
    zarr opens them."""
    for key in ("zarr.json", *(f"{name}/zarr.json" for name in names)):
        inside_root(loc, key)


def resolves_inside(path: str, root: str) -> bool:
    """Whether the local ``path`` resolves (through any links) to ``root`` or below it."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top + os.sep)


def exists(loc: Location, key: str) -> bool:
    """Whether the object ``key`` exists, bypassing any listing cache.

    On an object store this is one request, a GET of the first byte: s3fs's own ``exists``
    sends a HEAD and, when the object is missing (as a unit's commit record is before every
    commit), a LIST for a folder of that name.
    """
    return path_exists(loc, loc.path(key))


def path_exists(loc: Location, path: str) -> bool:
    """:func:`exists` of a filesystem path under ``loc`` the code names itself, not a key from
    the cache (zarr's own keys, such as ``.zgroup``, are not :func:`safe_key` keys)."""
    loc.fs.invalidate_cache(path)
    if not loc.is_local:
        try:
            loc.fs.cat_file(path, start=0, end=1)
            return True
        except FileNotFoundError:
            return False
        except OSError:
            pass  # S3 refuses any range of an empty object (416): ask the store itself
    return bool(loc.fs.exists(path))


def list_names(loc: Location, prefix: str) -> list[str]:
    """Names (last path part) directly under ``prefix``, fresh from the store; [] if absent."""
    path = loc.path(prefix)
    loc.fs.invalidate_cache(path)
    try:
        entries = loc.fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)


def _write_temp(target: Path, data: bytes, *, sync: bool = True) -> Path:
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: leave nothing behind
        raise
    return tmp


def remove_stale_partials(loc: Location, *, older_than_s: float) -> list[str]:
    """Delete temp files that a killed write left under a local root; returns their paths.

    Both this module and zarr's local store write ``<name>.<32 hex>.partial`` and rename it into
    place, so a process killed mid-write leaves one behind. Only files untouched for
    ``older_than_s`` are removed: a younger one may belong to a live writer (another worker).
    Object stores need nothing: their PUTs are whole or absent.
    """
    if not loc.is_local or not Path(loc.root).is_dir():
        return []
    deadline = time.time() - older_than_s
    removed = []
    for folder, _, names in os.walk(loc.root):
        for name in filter(_PARTIAL.search, names):
            path = Path(folder, name)
            try:
                if path.lstat().st_mtime < deadline:
                    path.unlink()
                    removed.append(str(path))
            except FileNotFoundError:
                continue  # renamed into place meanwhile
    return removed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def set_codec_threads(num_threads: int) -> None:
    """Size zarr's codec thread pool, where every chunk is compressed and decompressed.

    Zarr builds the pool on its first I/O in a process and keeps it, so this must run before
    anything opens a store; later it only warns.
    """
    import zarr.core.sync as zarr_sync

    zarr.config.set({"threading.max_workers": num_threads})
    pool = getattr(zarr_sync, "_executor", None)
    if pool is not None and getattr(pool, "_max_workers", num_threads) != num_threads:
        logger.warning("zarr's codec pool already runs with %s threads in this process; "
                       "%d requested (set it before the first store is opened)",
                       getattr(pool, "_max_workers", "?"), num_threads)
