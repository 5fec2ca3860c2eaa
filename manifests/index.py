"""The sample index (``index.parquet``): its schema."""

from __future__ import annotations

from typing import Final

import pyarrow as pa

INDEX_SCHEMA: Final = pa.schema([
    ("sample_id", pa.int64()), ("unit", pa.int64()), ("slot", pa.int64()),
    ("row_offset", pa.int64()), ("length", pa.int32()), ("num_loss_tokens", pa.int32()),
    ("source_row", pa.int64()), ("source_hash", pa.string()), ("split", pa.string()),
])
