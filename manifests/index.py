"""The sample index (``index.parquet``): written by finalize, checked by open and validate."""

from __future__ import annotations

import hashlib
import io
from typing import Final

import pyarrow as pa
import pyarrow.parquet as pq

from sparkforge.manifests.schema import CacheManifest

INDEX_SCHEMA: Final = pa.schema([
    ("sample_id", pa.int64()), ("unit", pa.int64()), ("slot", pa.int64()),
    ("row_offset", pa.int64()), ("length", pa.int32()), ("num_loss_tokens", pa.int32()),
    ("source_row", pa.int64()), ("source_hash", pa.string()), ("split", pa.string()),
])


def index_bytes(table: pa.Table) -> bytes:
    """The index (:data:`INDEX_SCHEMA`, sorted by sample id) as Parquet bytes."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=256 * 1024)
    return buf.getvalue()


def check_index(raw: bytes, manifest: CacheManifest) -> tuple[pa.Table | None, list[str]]:
    """The index read from ``raw`` and every way it disagrees with the manifest.

    Checks the sha256, the schema and the row count. The table is None when it cannot be read
    with the expected columns; the other checks still report alongside it.
    """
    key, recorded = manifest.storage.index_key, manifest.storage
    problems = []
    digest = hashlib.sha256(raw).hexdigest()
    if digest != recorded.index_sha256:
        problems.append(f"index {key}: sha256 {digest} != manifest storage.index_sha256 "
                        f"{recorded.index_sha256}")
    try:
        table = pq.read_table(io.BytesIO(raw))
    except pa.ArrowException as exc:
        return None, [*problems, f"index {key}: not a readable Parquet file ({exc})"]
    if not table.schema.equals(INDEX_SCHEMA):
        return None, [*problems,
                      f"index {key}: columns {table.schema.names} != {INDEX_SCHEMA.names}"]
    if table.num_rows != recorded.totals.samples:
        problems.append(f"index {key}: {table.num_rows} rows != manifest storage.totals.samples "
                        f"{recorded.totals.samples}")
    return table, problems
