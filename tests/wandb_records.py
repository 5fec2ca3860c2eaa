"""Read an offline W&B run's ``.wandb`` file: a LevelDB-log framed stream of protobuf records.

wandb writes the file through its Go core and ships no Python reader in recent releases, so the
framing is decoded here (7-byte file header ``:W&B`` + magic + version, then 32 KiB blocks of
records, each ``crc32 | length | type | data`` with FULL/FIRST/MIDDLE/LAST chunks) and each
record is parsed with wandb's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes) -> Iterator[tuple[int, bytes]]:
    assert data[:4] == b":W&B", data[:7]
    pos = HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # zero padding at a block's end
            pos += left
            continue
        yield kind, data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length


def records(path: Path) -> Iterator[Any]:
    """Every ``Record`` of the file, in order."""
    pending = b""
    for kind, chunk in _chunks(path.read_bytes()):
        if kind == FULL:
            payload = chunk
        elif kind in (FIRST, MIDDLE):
            pending += chunk
            continue
        else:
            payload, pending = pending + chunk, b""
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        yield record


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def history(path: Path) -> list[dict[str, Any]]:
    """The logged rows (``wandb.log`` calls), values decoded from JSON."""
    return [{_key(i): json.loads(i.value_json) for i in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]


def config(path: Path) -> dict[str, Any]:
    """The run's config after every update."""
    out: dict[str, Any] = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        update = r.config.update if kind == "config" else r.run.config.update if kind == "run" \
            else ()
        out |= {_key(i): json.loads(i.value_json) for i in update}
    return out
