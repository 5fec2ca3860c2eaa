"""Storage primitives: key safety, exclusive create, temp files."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sparkforge.shared import storage


@pytest.mark.parametrize("key", ["../escape", "/etc/passwd", "a/../../b", "a\\..\\b", "", ".hidden",
                                 "a//b", "a/./b", "-rf", "target/..", "~/x"])
def test_unsafe_keys_are_rejected(key: str) -> None:
    """Keys from untrusted records cannot leave the cache root."""
    with pytest.raises(storage.UnsafeKeyError, match="cache key"):
        storage.safe_key(key)


@pytest.mark.parametrize(
    "key", ["target/config.json", "index.parquet", "_commits/unit_00000001.json"])
def test_plain_keys_are_accepted(key: str) -> None:
    """Ordinary cache keys pass unchanged."""
    assert storage.safe_key(key) == key


@pytest.mark.parametrize("uri_kind", ["local", "file", "memory"])
def test_exclusive_create_never_overwrites(tmp_path: Path, uri_kind: str) -> None:
    """A second exclusive create fails and leaves the first object intact, no temp files."""
    uri = {"local": str(tmp_path / "c"), "file": f"file://{tmp_path}/c",
           "memory": f"memory://excl-{tmp_path.name}"}[uri_kind]
    loc = storage.open_location(uri)
    storage.exclusive_create(loc, "_commits/unit_00000000.json", b"first")
    with pytest.raises(FileExistsError):
        storage.exclusive_create(loc, "_commits/unit_00000000.json", b"second")
    assert storage.read_bytes(loc, "_commits/unit_00000000.json") == b"first"
    assert storage.list_names(loc, "_commits") == ["unit_00000000.json"]


def test_exclusive_create_on_s3_uses_if_none_match(moto_server: dict) -> None:
    """On S3 the server refuses the second create (If-None-Match), not a race-prone check."""
    loc = storage.open_location(f"s3://{moto_server['bucket']}/excl",
                                moto_server["storage_options"])
    storage.exclusive_create(loc, "k.json", b"first")
    with pytest.raises(FileExistsError):
        loc.fs.pipe_file(loc.path("k.json"), b"second", mode="create")
    assert storage.read_bytes(loc, "k.json") == b"first"


def test_failed_write_leaves_no_temp_file(tmp_path: Path) -> None:
    """A write that fails midway (here: data the file refuses) removes its temp file."""
    loc = storage.open_location(str(tmp_path / "c"))
    with pytest.raises(TypeError):
        storage.atomic_write(loc, "_meta/x.json", "not bytes")  # type: ignore[arg-type]
    assert list((tmp_path / "c").rglob("*")) == [tmp_path / "c" / "_meta"]


def test_only_stale_partials_are_removed(tmp_path: Path) -> None:
    """Temp files untouched for longer than the bound go (ours and zarr's naming); younger ones,
    other files and object stores are left alone."""
    root = tmp_path / "c"
    stale = [root / "_commits" / f".unit_00000001.json.{'0' * 32}.partial",
             root / "input_ids" / "c" / "3" / f"0.{'f' * 32}.partial"]
    young = root / f".manifest.json.{'1' * 32}.partial"
    other = root / "input_ids" / "c" / "3" / "0"
    for path in [*stale, young, other]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    for path in [*stale, other]:
        os.utime(path, (1_000_000, 1_000_000))
    removed = storage.remove_stale_partials(storage.open_location(str(root)), older_than_s=60)
    assert sorted(removed) == sorted(map(str, stale))
    assert [p.exists() for p in (*stale, young, other)] == [False, False, True, True]
    assert storage.remove_stale_partials(storage.open_location("memory://c"),
                                         older_than_s=0) == []


def test_pending_writes_end_before_wait_raises_the_failure(tmp_path: Path) -> None:
    """A failed write is raised by ``wait`` once every other write has ended; the last write
    given for a key is the one stored."""
    loc = storage.open_location(str(tmp_path / "c"))
    storage.atomic_write(loc, "blocker", b"a file, not a folder")
    with ThreadPoolExecutor(4) as pool:
        writes = storage.PendingWrites(loc, pool, max_in_flight=8, max_bytes=1 << 20)
        writes.write("blocker/x", b"cannot be written")
        for i in range(6):
            writes.write(f"ok/{i % 3}", f"version {i}".encode())
        with pytest.raises(FileExistsError, match="blocker"):
            writes.wait()
        assert [storage.read_bytes(loc, f"ok/{i}") for i in range(3)] == [
            b"version 3", b"version 4", b"version 5"]


@pytest.mark.parametrize("value", [
    "2026-12-03T14:00:00.000Z", "2026-12-03T14:00:00.123456Z", "2026-12-03T16:00:00+02:00",
    "Thu, 03 Dec 2026 14:33:29 GMT", "Thu, 03 Dec 2026 14:33:29 +0200",
    "Thu, 03 Dec 2026 14:33:29 -0000", "2026-12-03T14:00:00", "1764770000", 1764770000])
def test_s3_times_parse_to_the_instants_botocore_parses(value: object) -> None:
    """The cheaper parser of S3 times (listed ``LastModified``, a GET's ``Last-Modified``
    header) gives the instant botocore's own parser gives for ISO 8601 and HTTP dates with and
    without a zone and for Unix seconds."""
    from botocore.utils import parse_timestamp

    assert storage._parse_timestamp(value) == parse_timestamp(value)


_PAGE = (b'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws'
         b'.com/doc/2006-03-01/"><Name>b</Name><Prefix>c/</Prefix><KeyCount>1</KeyCount>'
         b'<IsTruncated>false</IsTruncated><Contents><Key>c/0</Key><Size>3</Size></Contents>'
         b'</ListBucketResult>\n')
_ERROR = b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code></Error>'


@pytest.mark.parametrize(("operation", "body"), [
    ("ListObjectsV2", _PAGE), ("ListObjectsV2", _PAGE[:-40]), ("ListObjectsV2", _ERROR),
    ("ListObjectsV2", b""), ("CompleteMultipartUpload", _ERROR), ("CopyObject", _PAGE[:-40])])
def test_s3_200_error_check_gives_botocores_verdict(operation: str, body: bytes) -> None:
    """The listing pages' cheaper check for an error inside a 200 answer leaves the status that
    botocore's check leaves: 200 for a whole page, 500 (retried) for a page cut off or an
    ``<Error>`` body, of a listing or of any other call."""
    import botocore.session
    from botocore.handlers import _handle_200_error

    model = botocore.session.get_session().get_service_model("s3").operation_model(operation)
    ours, theirs = ({"status_code": 200, "body": body, "headers": {}} for _ in range(2))
    storage._check_200_error(model, ours)
    _handle_200_error(model, theirs)
    assert ours["status_code"] == theirs["status_code"]


def test_read_many_stopped_early_reads_on_quietly(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A consumer that stops after one object leaves no error behind: the batches still being
    read finish or are cancelled without a callback failing (concurrent.futures logs those)."""
    for i in range(64):
        (tmp_path / f"k{i}").write_bytes(str(i).encode())
    loc = storage.open_location(str(tmp_path))
    reads = storage.read_many(loc, [f"k{i}" for i in range(64)], max_concurrency=4)
    assert next(reads) == ("k0", b"0")
    reads.close()  # type: ignore[attr-defined]
    assert [(k, v) for k, v in storage.read_many(loc, ["k5", "k63"], max_concurrency=4)] == [
        ("k5", b"5"), ("k63", b"63")]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
