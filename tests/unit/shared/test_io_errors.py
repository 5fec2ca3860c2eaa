"""Storage failures become one line naming the location and what to do."""

from __future__ import annotations

import errno
import gzip
import zlib

import pytest

from sparkforge.shared.io_errors import StorageError, storage_errors


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), "free space"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "quota"),
        (PermissionError(errno.EACCES, "Permission denied"), "permissions"),
        (FileNotFoundError(errno.ENOENT, "No such file"), "not found"),
        (EOFError("Compressed file ended before the end-of-stream marker was reached"),
         "truncated"),
        (gzip.BadGzipFile("Not a gzipped file (b'xx')"), "truncated"),
        (zlib.error("Error -3 while decompressing data"), "truncated"),
        (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), "cannot be reached"),
    ],
)
def test_each_failure_names_the_place_and_the_fix(error: BaseException, hint: str) -> None:
    """The message starts with the setting and URI, stays on one line and carries the hint."""
    with pytest.raises(StorageError) as info, storage_errors("output", "s3://b/cache"):
        raise error
    message = str(info.value)
    assert message.startswith("output s3://b/cache: ")
    assert hint in message
    assert "\n" not in message
    assert info.value.__cause__ is error


def test_other_errors_pass_through() -> None:
    """A bug or a data error is not disguised as a storage failure."""
    with pytest.raises(KeyError), storage_errors("data", "d.jsonl"):
        raise KeyError("x")
