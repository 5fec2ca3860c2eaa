"""Turn an operating-system, object-store or file-format failure into one line: where, what, and
what to do."""

from __future__ import annotations

import errno
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

from sparkforge.shared.errors import SparkforgeError

# Errors raised by the stores' clients that are not OSError subclasses, matched by module so that
# shared/ needs neither botocore nor google-auth installed.
_CLIENT_ERROR_MODULES = ("botocore.", "aiobotocore.", "google.", "gcsfs.", "aiohttp.", "pyarrow.")

_ERRNO_HINTS = {
    errno.ENOSPC: "no space left on the device: free space (or use another location) and re-run "
                  "the same command; committed units are kept",
    errno.EDQUOT: "disk quota exceeded: free space or raise the quota, then re-run the same "
                  "command",
    errno.EFBIG: "file size limit exceeded (ulimit -f or the file system's): raise it, then "
                 "re-run the same command",
    errno.EACCES: "permission denied: check the file permissions or the credentials",
    errno.EPERM: "operation not permitted: check the file permissions or the credentials",
    errno.EROFS: "read-only file system: use a writable location",
    errno.ENOENT: "not found: check the path, bucket and storage_options",
}


class StorageError(SparkforgeError, RuntimeError):
    """Raised when a file or object store cannot be read or written; the message is one line."""


def _hint(exc: BaseException) -> str:
    if isinstance(exc, EOFError | zlib.error) or "gzip" in type(exc).__name__.lower():
        return "the file is truncated or its compression is corrupt: re-create or re-copy it"
    if type(exc).__module__.startswith("pyarrow."):
        return "not a readable Parquet file (corrupt or truncated?): re-create or re-copy it"
    if isinstance(exc, OSError) and exc.errno in _ERRNO_HINTS:
        return _ERRNO_HINTS[exc.errno]
    if isinstance(exc, FileNotFoundError):
        return _ERRNO_HINTS[errno.ENOENT]
    if isinstance(exc, PermissionError):
        return _ERRNO_HINTS[errno.EACCES]
    if isinstance(exc, ConnectionError | TimeoutError) or "connect" in type(exc).__name__.lower():
        return "the store cannot be reached: check endpoint_url, the network and the service"
    return "check the location and the storage_options, then re-run the same command"


def is_storage_failure(exc: BaseException) -> bool:
    """OS errors, truncated compressed files, and the object-store clients' own errors."""
    return isinstance(exc, OSError | EOFError | zlib.error) or type(exc).__module__.startswith(
        _CLIENT_ERROR_MODULES)


def describe(what: str, uri: str | None, exc: BaseException) -> str:
    """``"<what> <uri>: <error> (<type>): <what to do>"`` on one line (without the location
    when it is not known)."""
    text = " ".join(str(exc).split())[:300] or type(exc).__name__
    where = f"{what} {uri}: " if uri else ""
    return f"{where}{text} ({type(exc).__name__}): {_hint(exc)}"


@contextmanager
def storage_errors(what: str, uri: str) -> Iterator[None]:
    """Re-raise a storage failure inside the block as :class:`StorageError` naming ``uri``.

    Args:
        what: The setting the location came from, e.g. ``"data"`` or ``"output"``.
        uri: The file or cache URI being read or written.
    """
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        if not is_storage_failure(exc):
            raise
        raise StorageError(describe(what, uri, exc)) from exc
