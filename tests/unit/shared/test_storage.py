"""Storage primitives: key safety and exclusive create."""

from __future__ import annotations

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
