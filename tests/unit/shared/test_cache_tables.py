"""Bookkeeping columns: the same values as the index rows, lookups by arithmetic, bytes per row."""

from __future__ import annotations

import io
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkforge.manifests.index import INDEX_SCHEMA
from sparkforge.shared.cache_tables import SampleColumns, SlotColumns, TableError
from sparkforge.shared.commit import SlotRecord


def _index(num: int, *, per_unit: int = 7, seed: int = 0) -> bytes:
    """index.parquet of ``num`` samples: units of ``per_unit`` samples stored in shuffled order
    inside each unit (so storage order is not sample-id order), every 5th sample in eval."""
    rng = np.random.default_rng(seed)
    ids = np.arange(num, dtype=np.int64) * 3 + 1
    unit = np.arange(num) // per_unit
    local = np.concatenate([rng.permutation(min(per_unit, num - u * per_unit))
                            for u in range(-(-num // per_unit))])
    length = rng.integers(1, 50, num)
    table = pa.table({
        "sample_id": ids, "unit": unit, "slot": unit * 10 + local // 4,
        "row_offset": unit * 1000 + local * 50, "length": length.astype(np.int32),
        "num_loss_tokens": (length // 2).astype(np.int32), "source_row": unit * 100 + local,
        "source_hash": [f"{i:064x}" for i in ids],
        "split": np.where(np.arange(num) % 5 == 4, "eval", "train")}, schema=INDEX_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=1000)
    return buf.getvalue()


def test_columns_hold_the_index_rows_and_find_units_in_storage_order() -> None:
    """Every column equals the Parquet rows; a unit's samples come back by row offset."""
    raw = _index(2500)
    rows = pq.read_table(io.BytesIO(raw)).to_pylist()
    cols = SampleColumns.from_parquet(io.BytesIO(raw), num_rows=len(rows), sources=True)
    assert len(cols) == len(rows)
    for name in ("sample_id", "unit", "slot", "row_offset", "length", "num_loss_tokens",
                 "source_row"):
        assert getattr(cols, name).tolist() == [r[name] for r in rows], name
    assert cols.source_hash is not None
    assert cols.source_hash.tolist() == [r["source_hash"].encode() for r in rows]
    assert cols.in_split("eval").tolist() == [r["split"] == "eval" for r in rows]
    assert cols.split_counts() == {"train": 2000, "eval": 500}
    for unit in (0, 17, 357):
        mine = sorted((r["row_offset"], r["sample_id"]) for r in rows if r["unit"] == unit)
        assert cols.sample_id[cols.of_unit(unit)].tolist() == [sid for _, sid in mine]
    assert cols.of_unit(10_000).size == 0
    assert cols.positions([4, 1, 7498]).tolist() == [1, 0, 2499]
    with pytest.raises(KeyError, match="sample 2 is not in the index"):
        cols.positions([1, 2])


def test_columns_skip_the_source_columns_unless_asked() -> None:
    """A reader that does not validate holds no source hashes."""
    cols = SampleColumns.from_parquet(io.BytesIO(_index(30)), num_rows=30)
    assert cols.source_hash is None
    assert cols.source_row is None


@pytest.mark.parametrize(("num_rows", "message"), [(29, "more rows than manifest .* 29"),
                                                   (31, "30 rows != manifest .* 31")])
def test_a_row_count_other_than_the_manifests_is_refused(num_rows: int, message: str) -> None:
    """The index must hold exactly the rows the manifest counts."""
    with pytest.raises(TableError, match=message):
        SampleColumns.from_parquet(io.BytesIO(_index(30)), num_rows=num_rows)


def test_unsorted_ids_or_unknown_splits_are_refused() -> None:
    """Lookups need increasing ids and known split codes."""
    base = {"sample_id": np.array([1, 3, 2]), "unit": np.zeros(3), "slot": np.zeros(3),
            "row_offset": np.arange(3), "length": np.ones(3), "num_loss_tokens": np.ones(3),
            "split": np.zeros(3)}
    with pytest.raises(TableError, match="sample_id not unique and increasing"):
        SampleColumns.from_columns(base)
    with pytest.raises(TableError, match="a split outside"):
        SampleColumns.from_columns({**base, "sample_id": np.arange(3), "split": np.full(3, 7)})


def test_slot_columns_sort_by_unit_and_slot_and_find_rows() -> None:
    """Slots of a unit are a slice; each crc32c sits in its array's column."""

    class Entry:
        def __init__(self, unit: int, slots: list[SlotRecord]) -> None:
            self.unit, self.slots = unit, slots

    def rec(slot: int, rows: int) -> SlotRecord:
        return SlotRecord(slot=slot, num_rows=rows, crc32c={"a": slot, "b": 0xFFFF_FFFF - slot})

    slots = SlotColumns.from_units([Entry(2, [rec(21, 5), rec(20, 3)]), Entry(0, [rec(1, 9)])],
                                   ("a", "b"))
    assert slots.unit.tolist() == [0, 2, 2]
    assert slots.slot.tolist() == [1, 20, 21]
    assert slots.num_rows[slots.of_unit(2)].tolist() == [3, 5]
    assert slots.of_unit(1) == slice(1, 1)
    assert slots.checksums(slots.row_of(2, 21)) == {"a": 21, "b": 0xFFFF_FFFF - 21}
    assert slots.crc32c.dtype == np.uint32
    with pytest.raises(KeyError, match="unit 2 has no slot 22"):
        slots.row_of(2, 22)
    with pytest.raises(TableError, match=r"unit 0, slot 1: no crc32c for \['c'\]"):
        SlotColumns.from_units([Entry(0, [rec(1, 9)])], ("a", "c"))


def _allocated_while_loading(num: int) -> tuple[int, int]:
    """Bytes and blocks still allocated after loading a ``num``-sample index (raw bytes freed)."""
    raw = _index(num, per_unit=256)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    cols = SampleColumns.from_parquet(io.BytesIO(raw), num_rows=num)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    stats = after.compare_to(before, "filename")
    assert len(cols) == num
    return sum(s.size_diff for s in stats), sum(s.count_diff for s in stats)


def test_columns_cost_bytes_not_objects_per_sample() -> None:
    """Loading 4x the samples allocates about 4x the bytes (<= 64 B each) and no more blocks:
    nothing is allocated per sample but column bytes."""
    small_bytes, small_blocks = _allocated_while_loading(20_000)
    big_bytes, big_blocks = _allocated_while_loading(80_000)
    assert big_bytes / 80_000 <= 64
    assert (big_bytes - small_bytes) / 60_000 <= 64
    assert big_blocks - small_blocks < 100


def test_a_unit_lookup_costs_the_units_samples_not_the_index() -> None:
    """In an index stored in sample-id order (as finalize writes it), finding one unit's samples
    allocates about that unit's positions, not one entry per sample of the index (every unit
    read of every DataLoader worker does it)."""
    num, per_unit = 400_000, 256
    ids = np.arange(num, dtype=np.int64)
    cols = SampleColumns.from_columns({
        "sample_id": ids, "unit": ids // per_unit, "slot": ids // per_unit,
        "row_offset": ids * 4, "length": np.full(num, 4), "num_loss_tokens": np.full(num, 4),
        "split": np.zeros(num, dtype=np.uint8)})
    assert cols.storage_order is None
    tracemalloc.start()
    mine = cols.of_unit(1000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert mine.tolist() == list(range(1000 * per_unit, 1001 * per_unit))
    assert peak < 16 * per_unit * 8
