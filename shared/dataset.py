"""Stream chat rows (JSONL or Parquet, any fsspec URI, or a Hugging Face dataset: see
``sparkforge.shared.hf_dataset``) in bounded batches with a hash per row.

A file that cannot be read (missing, unreadable, truncated compression, unreachable store) raises
StorageError naming it; a line that is not a JSON object is a row with an ``error``, never a crash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem

from sparkforge.shared import hf_dataset
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.io_errors import storage_errors
from sparkforge.shared.storage import check_regular, stream_sha256

logger = logging.getLogger(__name__)

DataFormat = Literal["auto", "jsonl", "parquet"]
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_READ_BLOCK_BYTES = 1 << 20
MAX_LINE_BYTES = 64 << 20
"""Default longest JSONL line (far above any real chat); a longer one is skipped unread."""
LINE_TOO_LONG = "line_too_long"
HF_DATASET_KEY = "sparkforge.hf_dataset"


def json_text_field(value: object) -> object:
    """A row's ``tools`` or a message's ``tool_calls``, parsed when given as JSON text (as many
    Hugging Face datasets and ``regenerate``'s parts store them); other text stays a string."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


class DatasetError(SparkforgeError):
    """Raised when a data source cannot be found or its format is unknown."""


@dataclass(frozen=True, kw_only=True)
class DataSource:
    """One input file: where it is, how it is stored, how many rows and what it contains."""

    uri: str
    format: Literal["jsonl", "parquet", "hf"]
    num_rows: int
    content_hash: str
    """sha256 of the file's bytes (JSONL: decompressed, so recompression keeps the identity;
    a Hugging Face dataset: of its name, revision, split and fingerprint)."""
    metadata: dict[str, Any]
    """Parquet key-value metadata under ``sparkforge.*`` (e.g. regeneration parameters); a
    Hugging Face dataset's identity under ``HF_DATASET_KEY``."""
    column: str | None = None
    """Hugging Face datasets: the conversation column (None: messages, else conversations)."""
    max_line_bytes: int = MAX_LINE_BYTES
    """JSONL: a longer line is a ``line_too_long`` row, never held in memory whole."""


@dataclass(frozen=True, kw_only=True)
class RawRow:
    """One input row; ``row`` is None when the line is not a JSON object (``error`` says why)."""

    index: int
    """Global row index over all sources, in order: the sample id."""
    row: Mapping[str, Any] | None
    content_hash: str
    error: str | None = None
    folder: str | None = None
    """The folder of the row's data file (a local path or a remote URI), against which its
    relative image paths resolve; None for a Hub dataset."""


def data_folder(source: DataSource) -> str | None:
    """The folder a source's rows resolve relative image paths in (None: a Hub dataset)."""
    if source.format == "hf":
        spec = hf_dataset.parse_spec(source.uri)
        return spec.name if spec.on_disk else None
    folder = source.uri.rsplit("/", 1)[0]
    return folder.removeprefix("file://") if folder.startswith("file:///") else folder


def row_hash(data: bytes) -> str:
    """Hex digest that identifies a raw row (128-bit BLAKE2b)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _format_of(uri: str, data_format: DataFormat) -> Literal["jsonl", "parquet"]:
    if data_format != "auto":
        return data_format
    name = uri.lower()
    for suffix in (".gz", ".bz2", ".xz", ".zst"):
        name = name.removesuffix(suffix)
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    raise DatasetError(f"data: cannot tell the format of {uri!r}; set --data_format jsonl|parquet")


def _expand(uri: str, storage_options: Mapping[str, Any]) -> list[str]:
    fs, _, paths = fsspec.get_fs_token_paths(uri, storage_options=dict(storage_options))
    if len(paths) == 1 and fs.isdir(paths[0]):
        paths = [p for p in fs.find(paths[0]) if not p.rsplit("/", 1)[-1].startswith(("_", "."))]
    if not paths or not all(fs.exists(p) for p in paths):
        raise DatasetError(f"data: no file matches {uri!r}")
    if isinstance(fs, LocalFileSystem):  # a FIFO would block the first read forever
        for path in paths:
            check_regular(path, f"data {path}")
    return [fs.unstrip_protocol(p) for p in sorted(paths)]


def describe_sources(
    uri: str, *, data_format: DataFormat = "auto", storage_options: Mapping[str, Any] | None = None,
    column: str | None = None, max_line_bytes: int = MAX_LINE_BYTES,
) -> list[DataSource]:
    """Resolve ``uri`` (a file, a folder or a glob) into its files with row counts and hashes.

    A Hugging Face dataset (``hf://...`` or a ``save_to_disk`` folder) is one source whose rows
    are read from ``column``. A JSONL line longer than ``max_line_bytes`` counts as one row that
    reads back as ``line_too_long``.

    One streaming pass per file (bounded memory); Parquet row counts come from the footer.
    """
    if hf_dataset.is_hf_dataset(uri):
        return [_describe_hf(uri, column)]
    if column is not None:
        raise DatasetError(f"data {uri}: a conversation column ({column!r}) is read from Hugging "
                           "Face datasets only; JSONL and Parquet rows hold 'messages'")
    options = dict(storage_options or {})
    sources = []
    with storage_errors("data", uri):
        paths = _expand(uri, options)
    for path in paths:
        fmt = _format_of(path, data_format)
        describe = _describe_jsonl if fmt == "jsonl" else _describe_parquet
        with storage_errors("data", path):
            digest, num_rows, metadata = describe(path, options, max_line_bytes)
        sources.append(DataSource(uri=path, format=fmt, num_rows=num_rows, content_hash=digest,
                                  metadata=metadata, max_line_bytes=max_line_bytes))
    return sources


def _describe_hf(uri: str, column: str | None) -> DataSource:
    dataset, identity = hf_dataset.open_dataset(hf_dataset.parse_spec(uri))
    if column is not None and column not in dataset.column_names:
        raise hf_dataset.HfDatasetError(
            f"data: {uri} has no column {column!r} (--data_column); its columns: "
            f"{', '.join(dataset.column_names)}")
    return DataSource(uri=uri, format="hf", num_rows=len(dataset),
                      content_hash=hf_dataset.content_hash(identity),
                      metadata={HF_DATASET_KEY: identity}, column=column)


def _iter_hf(source: DataSource, wanted: Any) -> Iterator[RawRow]:
    dataset, _ = hf_dataset.open_dataset(hf_dataset.parse_spec(source.uri))
    for index, row in hf_dataset.iter_dataset(dataset, wanted, source.column):
        raw = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
        yield RawRow(index=index, row=row, content_hash=row_hash(raw.encode()))


def _describe_jsonl(
    path: str, options: Mapping[str, Any], max_line_bytes: int
) -> tuple[str, int, dict[str, Any]]:
    digest = hashlib.sha256()
    num_rows = sum(1 for _ in _jsonl_rows(path, options, max_line_bytes, digest.update))
    return digest.hexdigest(), num_rows, {}


def _describe_parquet(
    path: str, options: Mapping[str, Any], max_line_bytes: int
) -> tuple[str, int, dict[str, Any]]:
    del max_line_bytes  # Parquet has no lines
    import pyarrow.parquet as pq

    with fsspec.open(path, "rb", **options) as f:
        digest = stream_sha256(f)
        f.seek(0)
        meta = pq.ParquetFile(f).metadata
    kv = meta.metadata or {}
    metadata = {k.decode(): json.loads(v) for k, v in kv.items() if k.startswith(b"sparkforge.")}
    return digest, meta.num_rows, metadata


def _jsonl_rows(
    path: str, options: Mapping[str, Any], max_line_bytes: int, on_block: Any = None
) -> Iterator[bytes | None]:
    """The stripped non-blank lines of a JSONL file; None for a line past ``max_line_bytes``.

    Reads bounded blocks: an over-long line is dropped block by block up to its newline, and a
    block of blank lines is passed over in one C-level strip. ``on_block`` sees every byte.
    """
    pending: list[bytes] = []
    pending_len, skipping = 0, False
    with fsspec.open(path, "rb", compression="infer", **options) as f:
        while block := f.read(_READ_BLOCK_BYTES):
            if on_block is not None:
                on_block(block)
            if skipping:
                end = block.find(b"\n")
                if end < 0:
                    continue
                skipping, block = False, block[end + 1:]
            if not pending_len and not block.strip():
                continue
            *lines, tail = block.split(b"\n")
            if lines:
                lines[0] = b"".join([*pending, lines[0]])
                pending, pending_len = [], 0
            for line in lines:
                if len(line) > max_line_bytes:
                    yield None
                elif raw := line.strip():
                    yield raw
            pending.append(tail)
            pending_len += len(tail)
            if pending_len > max_line_bytes:
                yield None
                pending, pending_len, skipping = [], 0, True
    if raw := b"".join(pending).strip():
        yield raw


def _iter_jsonl(
    path: str, options: Mapping[str, Any], wanted: Any, max_line_bytes: int
) -> Iterator[RawRow]:
    for index, raw in enumerate(_jsonl_rows(path, options, max_line_bytes)):
        if not wanted(index):
            continue
        if raw is None:
            yield RawRow(index=index, row=None,
                         content_hash=row_hash(f"{LINE_TOO_LONG}:{index}".encode()),
                         error=f"{LINE_TOO_LONG}: the line is longer than {max_line_bytes:,} bytes "
                               "(--max_line_bytes)")
        else:
            yield _parse_line(index, raw)


def _parse_line(index: int, raw: bytes) -> RawRow:
    digest = row_hash(raw)
    try:
        row = json.loads(raw)
    except ValueError as exc:  # bad JSON or UTF-8, an integer past Python's 4300-digit limit
        return RawRow(index=index, row=None, content_hash=digest,
                      error=f"malformed_json: {str(exc)[:200]}")
    except RecursionError:
        return RawRow(index=index, row=None, content_hash=digest,
                      error="malformed_json: nested deeper than the JSON parser's recursion limit")
    if not isinstance(row, dict):
        return RawRow(index=index, row=None, content_hash=digest,
                      error=f"malformed_json: a row must be an object, got {type(row).__name__}")
    return RawRow(index=index, row=row, content_hash=digest)


def _iter_parquet(
    path: str, options: Mapping[str, Any], wanted: Any, batch_rows: int
) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    index = 0
    with fsspec.open(path, "rb", **options) as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_rows):
            if not any(wanted(i) for i in range(index, index + batch.num_rows)):
                index += batch.num_rows
                continue
            for row in batch.to_pylist():
                if wanted(index):
                    raw = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
                    yield RawRow(index=index, row=row, content_hash=row_hash(raw.encode()))
                index += 1


def iter_rows(
    sources: list[DataSource],
    *,
    wanted: Any = None,
    batch_rows: int = 1024,
    storage_options: Mapping[str, Any] | None = None,
) -> Iterator[RawRow]:
    """Yield the rows of ``sources`` in order, with global indices.

    Args:
        sources: From :func:`describe_sources`.
        wanted: Optional ``(global_index) -> bool``; rows it rejects are counted but not parsed.
        batch_rows: Parquet record-batch size (memory is bounded by one batch).
        storage_options: fsspec options for every source.
    """
    options = dict(storage_options or {})
    offset = 0
    for source in sources:
        base, folder = offset, data_folder(source)

        def local_wanted(i: int, base: int = base) -> bool:
            return wanted is None or bool(wanted(base + i))

        rows = (
            _iter_jsonl(source.uri, options, local_wanted, source.max_line_bytes)
            if source.format == "jsonl"
            else _iter_hf(source, local_wanted) if source.format == "hf"
            else _iter_parquet(source.uri, options, local_wanted, batch_rows)
        )
        with storage_errors("data", source.uri):
            for raw in rows:
                yield dataclasses.replace(raw, index=base + raw.index, folder=folder)
        offset += source.num_rows
