"""The streaming row reader: formats, global indices, bad lines, hashes, filtering, bad files."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from producer_helpers import write_jsonl

from sparkforge.shared.dataset import DatasetError, describe_sources, iter_rows
from sparkforge.shared.io_errors import StorageError
from sparkforge.shared.storage import IrregularObjectError

ROWS = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(7)]


def test_jsonl_bad_lines_become_bad_rows(tmp_path: Path) -> None:
    """A malformed line or a non-object is one bad row with an error; blank lines are not rows."""
    lines = [json.dumps(ROWS[0]), "{not json", "", json.dumps([1, 2]), json.dumps(ROWS[1])]
    write_jsonl(tmp_path / "d.jsonl", lines)
    (source,) = describe_sources(str(tmp_path / "d.jsonl"))
    assert source.num_rows == 4
    assert source.format == "jsonl"
    rows = list(iter_rows([source]))
    assert [r.index for r in rows] == [0, 1, 2, 3]
    assert [r.error is None for r in rows] == [True, False, False, True]
    assert rows[1].error.startswith("malformed_json")
    assert rows[3].row == ROWS[1]
    assert len({r.content_hash for r in rows}) == 4


def test_sources_concatenate_with_global_indices(tmp_path: Path) -> None:
    """A folder of JSONL(.gz) and Parquet files is read in name order with running indices."""
    write_jsonl(tmp_path / "a.jsonl", [json.dumps(r) for r in ROWS[:3]])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in ROWS[3:5]) + "\n")
    pq.write_table(pa.Table.from_pylist(ROWS[5:]), tmp_path / "c.parquet", row_group_size=1)
    sources = describe_sources(str(tmp_path))
    assert [s.num_rows for s in sources] == [3, 2, 2]
    rows = list(iter_rows(sources, batch_rows=1))
    assert [r.index for r in rows] == list(range(7))
    assert [r.row["messages"][0]["content"] for r in rows] == [f"q{i}" for i in range(7)]


def test_wanted_filters_without_shifting_indices(tmp_path: Path) -> None:
    """Rows the filter rejects are skipped but still counted for the indices of later rows."""
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    sources = describe_sources(str(tmp_path / "d.parquet"))
    rows = list(iter_rows(sources, wanted=lambda i: i % 3 == 1, batch_rows=2))
    assert [r.index for r in rows] == [1, 4]


def test_hashes_are_stable_and_content_based(tmp_path: Path) -> None:
    """The same row content gives the same row hash; the file hash changes with any byte."""
    write_jsonl(tmp_path / "a.jsonl", [json.dumps(ROWS[0]), json.dumps(ROWS[0])])
    (a,) = describe_sources(str(tmp_path / "a.jsonl"))
    first, second = iter_rows([a])
    assert first.content_hash == second.content_hash
    write_jsonl(tmp_path / "a.jsonl", [json.dumps(ROWS[0]), json.dumps(ROWS[1])])
    (b,) = describe_sources(str(tmp_path / "a.jsonl"))
    assert a.content_hash != b.content_hash


def test_unknown_format_and_missing_file_name_the_field(tmp_path: Path) -> None:
    """A file with no known suffix or a missing path is a DatasetError naming data."""
    (tmp_path / "d.txt").write_text("x\n")
    with pytest.raises(DatasetError, match="data"):
        describe_sources(str(tmp_path / "d.txt"))
    with pytest.raises(DatasetError, match="data"):
        describe_sources(str(tmp_path / "missing.jsonl"))
    assert describe_sources(str(tmp_path / "d.txt"), data_format="jsonl")[0].num_rows == 1


@pytest.mark.parametrize("where", ["file", "folder"])
def test_a_fifo_as_data_is_named_not_read(tmp_path: Path, where: str) -> None:
    """--data on a FIFO, or on a folder holding one, is refused in one line (reading it would
    wait for a writer forever)."""
    write_jsonl(tmp_path / "a.jsonl", [json.dumps(ROWS[0])])
    os.mkfifo(tmp_path / "b.jsonl")
    uri = tmp_path if where == "folder" else tmp_path / "b.jsonl"
    with pytest.raises(IrregularObjectError, match=rf"^data {tmp_path / 'b.jsonl'}: a FIFO "
                                                   r"\(named pipe\), not a regular file"):
        describe_sources(str(uri))


def test_json_nested_past_the_recursion_limit_is_a_bad_row(tmp_path: Path) -> None:
    """A line nested 200k deep is one malformed_json row, and the rows after it are read."""
    write_jsonl(tmp_path / "d.jsonl", ["[" * 200_000 + "]" * 200_000, json.dumps(ROWS[0])])
    rows = list(iter_rows(describe_sources(str(tmp_path / "d.jsonl"))))
    assert rows[0].row is None
    assert rows[0].error.startswith("malformed_json: nested deeper")
    assert rows[1].row == ROWS[0]


def _truncated_gz(path: Path) -> None:
    data = gzip.compress(("\n".join(json.dumps(r) for r in ROWS * 50) + "\n").encode())
    path.write_bytes(data[: len(data) // 2])


def _not_parquet(path: Path) -> None:
    path.write_bytes(b"PAR1 these bytes are not a parquet file")


@pytest.mark.parametrize(
    ("name", "plant", "hint"),
    [
        ("d.jsonl.gz", _truncated_gz, "truncated"),
        ("d.parquet", _not_parquet, "not a readable Parquet file"),
    ],
)
def test_unreadable_file_is_one_line_naming_it(tmp_path: Path, name, plant, hint) -> None:
    """A truncated .gz or a corrupt Parquet file is a StorageError naming the file and the fix."""
    plant(tmp_path / name)
    with pytest.raises(StorageError) as info:
        describe_sources(str(tmp_path / name))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"data file://{tmp_path / name}: ")
    assert hint in message


def test_missing_bucket_and_lost_endpoint_name_the_uri(moto_server: dict) -> None:
    """Data in a bucket that does not exist, or behind an endpoint that is gone, is refused in
    one line naming the URI."""
    options = moto_server["storage_options"]
    with pytest.raises((StorageError, DatasetError), match="s3://no-such-bucket/d.jsonl"):
        describe_sources("s3://no-such-bucket/d.jsonl", storage_options=options)
    gone = {**options, "endpoint_url": "http://127.0.0.1:9", "config_kwargs": {
        "connect_timeout": 1, "retries": {"max_attempts": 1}}}
    uri = f"s3://{moto_server['bucket']}/d.jsonl"
    with pytest.raises(StorageError, match="the store cannot be reached") as info:
        describe_sources(uri, storage_options=gone)
    assert uri in str(info.value)


def test_an_over_long_line_is_one_row_never_held_whole(tmp_path: Path) -> None:
    """A gzipped 24 MiB line past max_line_bytes is one ``line_too_long`` row; its neighbours,
    the file's hash and the reader's memory (well under the line) are unaffected."""
    import hashlib
    import tracemalloc

    cap = 1 << 20
    lines = [json.dumps(ROWS[0]), '{"x": "' + "a" * (24 << 20) + '"}', json.dumps(ROWS[1]),
             '{"y": "' + "b" * (cap + 10) + '"}', json.dumps(ROWS[2])]
    text = "\n".join(lines) + "\n"
    with gzip.open(tmp_path / "d.jsonl.gz", "wt", compresslevel=1) as f:
        f.write(text)
    del lines
    tracemalloc.start()
    (source,) = describe_sources(str(tmp_path / "d.jsonl.gz"), max_line_bytes=cap)
    rows = list(iter_rows([source]))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert source.num_rows == 5
    assert source.content_hash == hashlib.sha256(text.encode()).hexdigest()
    assert [r.row for r in rows[::2]] == ROWS[:3]
    assert [r.error.split(":")[0] for r in rows[1::2]] == ["line_too_long"] * 2
    assert "1,048,576 bytes" in rows[1].error
    assert peak < 8 << 20, peak


@pytest.mark.parametrize("block", [1, 7, 1 << 20])
def test_block_reading_keeps_lines_blank_lines_and_hashes(tmp_path: Path, block: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines split across read blocks, blank runs and a missing final newline read as before."""
    from sparkforge.shared import dataset

    monkeypatch.setattr(dataset, "_READ_BLOCK_BYTES", block)
    text = ("\n \n\n" + json.dumps(ROWS[0]) + "\n" + "\n" * 50 + "  " + json.dumps(ROWS[1])
            + "  \n\t\n" + json.dumps(ROWS[2]))
    (tmp_path / "d.jsonl").write_text(text)
    (source,) = describe_sources(str(tmp_path / "d.jsonl"))
    rows = list(iter_rows([source]))
    assert source.num_rows == 3
    assert [r.row for r in rows] == ROWS[:3]
    assert rows[1].content_hash == dataset.row_hash(json.dumps(ROWS[1]).encode())


def test_gzipped_blank_lines_hold_no_rows(tmp_path: Path) -> None:
    """64 MiB of blank lines (gzipped to ~64 KiB) describe as zero rows and read none."""
    with gzip.open(tmp_path / "blank.jsonl.gz", "wb") as f:
        for _ in range(64):
            f.write(b"\n" * (1 << 20))
    (source,) = describe_sources(str(tmp_path / "blank.jsonl.gz"))
    assert source.num_rows == 0
    assert list(iter_rows([source])) == []
