"""The sample index (``index.parquet``): its schema, and the digest finalize records for it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Final

import pyarrow as pa

INDEX_SCHEMA: Final = pa.schema([
    ("sample_id", pa.int64()), ("unit", pa.int64()), ("slot", pa.int64()),
    ("row_offset", pa.int64()), ("length", pa.int32()), ("num_loss_tokens", pa.int32()),
    ("source_row", pa.int64()), ("source_hash", pa.string()), ("split", pa.string()),
])


def file_sha256(path: str | Path) -> str:
    """The sha256 of a local file, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
