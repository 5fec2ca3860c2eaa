"""Where a data row's images may be read from: the operator's allow-list, checked at every read.

A chat row names its image sources, so without a rule the dataset's author would decide what the
producer contacts (a metadata service, an internal host, any file). The operator decides instead:

- data URIs and inline bytes always read;
- a local path reads only inside the folder of the row's data file or a folder named in
  ``--image_sources`` (symbolic links resolved first); a relative path is resolved against the
  data file's folder, never the current directory; only regular files are opened;
- a remote URI reads only under a prefix named in ``--image_sources`` (``s3://bucket/prefix``,
  ``gs://bucket``, ``https://host[:port]/prefix``) or under the data file's own remote folder;
  chained or nested protocols (``simplecache::``, ``zip://...::``) are refused; http(s) goes
  through :mod:`sparkforge.shared.safe_http` (no redirect, never a link-local or metadata
  address);
- every read is bounded in bytes (``--max_image_bytes``) and seconds (``--image_read_timeout_s``).

Each refusal is an :class:`~sparkforge.shared.images.ImageProblem` of its own, so a run counts
refused rows by reason and carries on.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import posixpath
import re
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, urlsplit

import fsspec

from sparkforge.shared import safe_http
from sparkforge.shared.images import ImageProblem

logger = logging.getLogger(__name__)

DEFAULT_MAX_IMAGE_BYTES = 64 << 20
"""Largest encoded image read by default (a 4096 x 4096 RGB image is 48 MiB raw)."""
DEFAULT_IMAGE_READ_TIMEOUT_S = 30.0
"""Longest read of one image by default."""
HTTP_PROTOCOLS = frozenset({"http", "https"})
STORE_PROTOCOLS = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "az",
                   "abfss": "az"}
"""Object-store protocols an operator may allow, each mapped to the name its aliases share."""
_LOCAL_PROTOCOLS = ("file", "local")
_READ_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class RemotePrefix:
    """An allowed remote prefix: protocol, bucket or ``host[:port]``, and a path prefix."""

    protocol: str
    netloc: str
    path: str
    """Normalized, without a trailing slash ("" allows the whole bucket or host)."""

    def covers(self, url: SplitResult) -> bool:
        """Whether ``url`` (normalized) lies under this prefix."""
        if _protocol_name(url.scheme) != self.protocol or _netloc(url) != self.netloc:
            return False
        return not self.path or url.path == self.path or url.path.startswith(self.path + "/")


def parse_image_sources(entries: Sequence[str]) -> tuple[tuple[Path, ...], tuple[RemotePrefix,
                                                                                  ...]]:
    """The local folders and remote prefixes of ``--image_sources``.

    Raises:
        ValueError: an entry that names no folder or no supported remote prefix.
    """
    folders: list[Path] = []
    prefixes: list[RemotePrefix] = []
    for k, entry in enumerate(entries):
        where = f"--image_sources[{k}] {entry!r}"
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"{where}: expected a folder or a remote prefix")
        if _chained(entry):
            raise ValueError(f"{where}: chained protocols are never allowed")
        scheme, sep, rest = entry.partition("://")
        if not sep or scheme in _LOCAL_PROTOCOLS:
            folders.append(Path(rest if sep else entry).resolve())
            continue
        if scheme not in HTTP_PROTOCOLS and scheme not in STORE_PROTOCOLS:
            raise ValueError(f"{where}: protocol {scheme!r} cannot be allowed (allowed: local "
                             f"folders, {', '.join(sorted({*HTTP_PROTOCOLS, *STORE_PROTOCOLS}))})")
        url = _normalized(urlsplit(entry))
        if url is None or not _netloc(url):
            raise ValueError(f"{where}: name the bucket or host (e.g. s3://bucket/images, "
                             "https://images.example.com/prefix)")
        prefixes.append(RemotePrefix(_protocol_name(url.scheme), _netloc(url),
                                     url.path.rstrip("/")))
    return tuple(folders), tuple(prefixes)


@dataclass(frozen=True, kw_only=True)
class ImageReader:
    """Reads image sources under the operator's allow-list and limits."""

    folders: tuple[Path, ...] = ()
    """Local folders whose files may be read (resolved, symbolic links followed)."""
    prefixes: tuple[RemotePrefix, ...] = ()
    """Remote prefixes whose objects may be read."""
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """fsspec options for object-store reads."""
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    timeout_s: float = DEFAULT_IMAGE_READ_TIMEOUT_S

    @classmethod
    def from_options(cls, image_sources: Sequence[str], *,
                     storage_options: Mapping[str, Any] | None = None,
                     max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
                     timeout_s: float = DEFAULT_IMAGE_READ_TIMEOUT_S) -> ImageReader:
        """A reader for a job's ``--image_sources``, ``--max_image_bytes`` and
        ``--image_read_timeout_s``."""
        folders, prefixes = parse_image_sources(image_sources)
        return cls(folders=folders, prefixes=prefixes, storage_options=dict(storage_options or {}),
                   max_bytes=max_bytes, timeout_s=timeout_s)

    def read(self, source: str | bytes, *, folder: str | None) -> bytes | ImageProblem:
        """The encoded bytes of one image source of a row from ``folder`` (its data file's
        folder: a local path or a remote URI; None when the row has none)."""
        if isinstance(source, bytes):
            return source if len(source) <= self.max_bytes else ImageProblem.TOO_MANY_BYTES
        if source.startswith("data:"):
            return self._data_uri(source)
        if _chained(source):
            return self._refused(ImageProblem.PROTOCOL_REFUSED, source, "a chained protocol")
        scheme, sep, rest = source.partition("://")
        if not sep or scheme in _LOCAL_PROTOCOLS:
            return self._local(rest if sep else source, folder)
        if scheme not in HTTP_PROTOCOLS and scheme not in STORE_PROTOCOLS:
            return self._refused(ImageProblem.PROTOCOL_REFUSED, source,
                                 f"protocol {scheme!r} is never read")
        url = _normalized(urlsplit(source))
        if url is None:
            return self._refused(ImageProblem.SOURCE_REFUSED, source, "'..' leaves the prefix")
        return self._remote(url, source, folder)

    def _data_uri(self, source: str) -> bytes | ImageProblem:
        header, sep, payload = source.partition(",")
        if not sep or not header.endswith(";base64"):
            return ImageProblem.UNREADABLE
        if len(payload) // 4 * 3 > self.max_bytes:
            return ImageProblem.TOO_MANY_BYTES
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            return ImageProblem.UNREADABLE

    def _local(self, path: str, folder: str | None) -> bytes | ImageProblem:
        local_folder = None if folder is None or "://" in folder else folder
        if not Path(path).is_absolute():
            if folder is not None and local_folder is None:  # a remote data file's folder
                return self.read(posixpath.join(folder, path), folder=folder)
            if local_folder is None:
                return self._refused(ImageProblem.PATH_REFUSED, path,
                                     "a relative path and no local data folder to resolve it in")
            path = str(Path(local_folder) / path)
        real = Path(path).resolve()
        allowed = [*self.folders, *([Path(local_folder).resolve()] if local_folder else [])]
        if not any(real.is_relative_to(f) for f in allowed):
            return self._refused(ImageProblem.PATH_REFUSED, path,
                                 "outside the data file's folder and every --image_sources folder")
        return self._read_local(real)

    def _read_local(self, path: Path) -> bytes | ImageProblem:
        deadline = time.monotonic() + self.timeout_s
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError:
            return ImageProblem.MISSING
        except OSError:  # permissions, a symbolic link swapped in after the check
            return ImageProblem.UNREADABLE
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # a FIFO, a device (/dev/zero), a folder
            os.close(fd)
            return ImageProblem.NOT_A_FILE
        with os.fdopen(fd, "rb", buffering=0) as f:
            if info.st_size > self.max_bytes:
                return ImageProblem.TOO_MANY_BYTES
            return _bounded_read(f, self.max_bytes, deadline)

    def _remote(self, url: SplitResult, source: str, folder: str | None) -> bytes | ImageProblem:
        allowed = list(self.prefixes)
        home = _folder_prefix(folder)
        if home is not None:
            allowed.append(home)
        if not any(p.covers(url) for p in allowed):
            return self._refused(ImageProblem.SOURCE_REFUSED, source,
                                 "under no --image_sources prefix")
        if url.scheme in HTTP_PROTOCOLS:
            return self._http(url, source)
        return self._store(url.geturl())

    def _http(self, url: SplitResult, source: str) -> bytes | ImageProblem:
        try:
            return safe_http.bounded_get(url, safe_http.Limits(self.max_bytes, self.timeout_s))
        except safe_http.FetchRefused as exc:
            return self._refused(ImageProblem.ADDRESS_REFUSED, source, str(exc))
        except safe_http.FetchFailed as exc:
            logger.debug("image %s: %s", source[:200], exc)
            return _FETCH_PROBLEMS[exc.kind]

    def _store(self, uri: str) -> bytes | ImageProblem:
        deadline = time.monotonic() + self.timeout_s
        try:
            with fsspec.open(uri, "rb", **dict(self.storage_options)) as f:
                size = getattr(f, "size", None)
                if isinstance(size, int) and size > self.max_bytes:
                    return ImageProblem.TOO_MANY_BYTES
                return _bounded_read(f, self.max_bytes, deadline)
        except FileNotFoundError:
            return ImageProblem.MISSING
        except Exception as exc:  # noqa: BLE001 - any client failure is this image's problem
            logger.warning("image %s: %s: %s", uri[:200], type(exc).__name__, str(exc)[:200])
            return ImageProblem.UNREADABLE

    def _refused(self, problem: ImageProblem, source: str, why: str) -> ImageProblem:
        logger.warning("image source %r refused (%s): %s; see --image_sources", source[:200],
                       problem.value, why)
        return problem


_FETCH_PROBLEMS = {"missing": ImageProblem.MISSING, "too_large": ImageProblem.TOO_MANY_BYTES,
                   "timeout": ImageProblem.READ_TIMEOUT, "unreadable": ImageProblem.UNREADABLE}


def _bounded_read(f: Any, max_bytes: int, deadline: float) -> bytes | ImageProblem:
    chunks, total = [], 0
    while chunk := f.read(_READ_CHUNK_BYTES):
        total += len(chunk)
        if total > max_bytes:
            return ImageProblem.TOO_MANY_BYTES
        if time.monotonic() > deadline:
            return ImageProblem.READ_TIMEOUT
        chunks.append(chunk)
    return b"".join(chunks)


def _chained(source: str) -> bool:
    """Whether fsspec would read ``source`` through a chain (``a::b``); the colons of an IPv6
    literal (``http://[fe80::1]/``) and of a local file name do not count."""
    return "://" in source and "::" in re.sub(r"\[[0-9A-Fa-f:.%]*\]", "", source)


def _protocol_name(scheme: str) -> str:
    return STORE_PROTOCOLS.get(scheme.lower(), scheme.lower())


def _netloc(url: SplitResult) -> str:
    """The bucket, or an http host as ``host[:port]`` (lower case, the default port left out)."""
    if url.scheme.lower() not in HTTP_PROTOCOLS:
        return url.netloc
    host = (url.hostname or "").lower()
    default = 443 if url.scheme.lower() == "https" else 80
    return host if url.port in (None, default) else f"{host}:{url.port}"


def _normalized(url: SplitResult) -> SplitResult | None:
    """``url`` with its path normalized; None if ``..`` climbs above its root or the URL
    carries credentials."""
    if url.username is not None or url.password is not None:
        return None
    path = url.path
    if path:
        normal = posixpath.normpath(path)
        if normal.startswith("/.."):
            return None
        path = "" if normal == "/" else normal
    return url._replace(path=path)


def _folder_prefix(folder: str | None) -> RemotePrefix | None:
    """The data file's own remote folder as an allowed prefix (None: local or none)."""
    if folder is None or "://" not in folder or _chained(folder):
        return None
    url = _normalized(urlsplit(folder))
    if url is None or (url.scheme not in HTTP_PROTOCOLS and url.scheme not in STORE_PROTOCOLS):
        return None
    return RemotePrefix(_protocol_name(url.scheme), _netloc(url), url.path.rstrip("/"))
