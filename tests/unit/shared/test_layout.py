"""Chunk math and spec validation of the cache layout."""

from __future__ import annotations

import pytest

from sparkforge.shared.layout import CacheSpec, first_slot, inner_chunk_rows, slots_per_attempt


@pytest.mark.parametrize(("hidden", "rows"), [(2048, 128), (4096, 64), (7168, 32)])
def test_inner_chunk_rows_follow_storage_notes(hidden: int, rows: int) -> None:
    """c(H) for F=3 bf16 is 128/64/32 rows at H=2048/4096/7168 (>= 1 MiB chunks)."""
    assert inner_chunk_rows(2 * 3 * hidden, 8192) == rows


def test_inner_chunk_divides_small_shards() -> None:
    """Tiny rows are capped so the inner chunk still divides shard_rows."""
    assert inner_chunk_rows(16384, 96) == 32  # 64 rows reach 1 MiB, 64 does not divide 96
    assert inner_chunk_rows(4, 96) == 96  # a whole shard is below 1 MiB: one inner chunk


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"hidden_dtype": "int8"}, "hidden_dtype must be one of"),
    ({"aux_codec": "zip"}, "aux_codec must be"),
    ({"topk": -1}, "topk must be"),
    ({"rows_per_unit": 1 << 20, "shard_rows": 1 << 22}, "too large for the slot address"),
    ({"shard_rows": 5_000_000}, "shard_rows must be <= 4,194,304, got 5,000,000"),
    ({"rows_per_unit": 1 << 21}, "rows_per_unit must be <= 1,048,576"),
])
def test_bad_spec_names_the_field(kwargs: dict, match: str) -> None:
    """CacheSpec rejects bad values with a message naming the field."""
    base = {"hidden_size": 64, "num_aux_layers": 2, "hidden_dtype": "bfloat16",
            "max_seq_len": 128}
    with pytest.raises(ValueError, match=match):
        CacheSpec(**(base | kwargs))


@pytest.mark.parametrize("max_seq_len", [8, 20])
def test_attempt_slot_ranges_are_disjoint(max_seq_len: int) -> None:
    """Different (unit, attempt) pairs own non-overlapping slot ranges, room for every sample
    to span ceil(max_seq_len / shard_rows) slots (samples longer than a slot are accepted)."""
    spec = CacheSpec(hidden_size=8, num_aux_layers=1, hidden_dtype="float32",
                     max_seq_len=max_seq_len, shard_rows=8, rows_per_unit=4)
    assert slots_per_attempt(spec) == 4 * -(-max_seq_len // 8)
    starts = sorted(first_slot(spec, u, a) for u in range(3) for a in range(3))
    assert all(b - a >= slots_per_attempt(spec) for a, b in zip(starts, starts[1:], strict=False))
