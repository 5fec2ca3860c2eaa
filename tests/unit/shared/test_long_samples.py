"""Samples longer than a slot: written over consecutive slots, read back whole, validated deep,
and written exactly once after a crash in the middle of one."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from cache_helpers import make_run_header, make_unit

from sparkforge.manifests.finalize import finalize_cache
from sparkforge.manifests.open import open_cache
from sparkforge.manifests.summary import summarize_cache
from sparkforge.manifests.validate import validate_cache
from sparkforge.shared.commit_columns import parse_commit_columns
from sparkforge.shared.fields import ManifestError
from sparkforge.shared.layout import CacheSpec, commit_key, row_selection
from sparkforge.shared.reader import CacheReader, ChecksumError
from sparkforge.shared.records import SampleRecord, SampleRows
from sparkforge.shared.writer import CacheWriter, UnitStream

SPEC = CacheSpec(hidden_size=16, num_aux_layers=2, hidden_dtype="bfloat16", max_seq_len=80,
                 shard_rows=32, rows_per_unit=5)
LENGTHS = {0: [70, 10, 20, 40], 1: [40, 80, 5, 33]}
"""Unit 0: 70 rows over slots 0-2 (32 + 32 + 6), 10 after it in slot 2, 20 in slot 3, 40 over
slots 4-5; unit 1: 40 over two slots, 80 over three (the longest sample), 5 and 33."""
USED_ROWS = {0: [32, 32, 16, 20, 32, 8], 1: [32, 8, 32, 32, 21, 32, 1]}
WIDE = dataclasses.replace(SPEC, shard_rows=128)
"""The same samples with every one inside a slot, as every cache before spanning slots."""
FIELDS = ("input_ids", "loss_mask", "aux_hidden", "final_hidden")


def _records(unit: int) -> list[SampleRecord]:
    return make_unit(SPEC, unit, lengths=LENGTHS[unit])[0]


def _write(path: Path, spec: CacheSpec) -> Path:
    w = CacheWriter.open(str(path), spec=spec, header=make_run_header(spec, num_units=2))
    for unit in LENGTHS:
        w.write_unit(unit, *make_unit(spec, unit, lengths=LENGTHS[unit]))
    finalize_cache(str(path), expected_units=2)
    return path


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("long")
    return _write(root / "spanning", SPEC), _write(root / "wide", WIDE)


def _slots(reader: CacheReader[Any], unit: int) -> list[int]:
    return reader.slots.slot[reader.slots.of_unit(unit)].tolist()


def _assert_same(got: Any, want: Any) -> None:
    assert got.sample_id == want.sample_id
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


def test_a_sample_three_slots_long_reads_back_bit_exact(caches: tuple[Path, Path]) -> None:
    """Each sample reads back as written and as the cache with one-slot samples has it, by unit
    and one at a time (checked or not); the index records each sample's first slot."""
    spanning, wide = (open_cache(str(c)) for c in caches)
    for unit in LENGTHS:
        slots = _slots(spanning, unit)
        assert slots == list(range(slots[0], slots[0] + len(USED_ROWS[unit])))
        assert spanning.slots.num_rows[spanning.slots.of_unit(unit)].tolist() == USED_ROWS[unit]
        expected, theirs = _records(unit), wide.read_unit(unit)
        for got, want, same in zip(spanning.read_unit(unit), expected, theirs, strict=True):
            _assert_same(got, want)
            _assert_same(got, same)
    first = int(spanning.samples.positions([0])[0])
    assert int(spanning.samples.slot[first]) == _slots(spanning, 0)[0]
    assert int(spanning.samples.row_offset[first]) == _slots(spanning, 0)[0] * SPEC.shard_rows
    unverified = open_cache(str(caches[0]), verify=False)
    for want in _records(0) + _records(1):
        _assert_same(spanning.read_sample(want.sample_id), want)
        _assert_same(unverified.read_sample(want.sample_id), want)
    summary = summarize_cache(str(caches[0]))  # inspect
    assert (summary["shards"], summary["tokens"]) == (13, sum(map(sum, LENGTHS.values())))
    assert summary["warnings"] == []
    assert {a["objects"] for a in summary["arrays"].values()} == {13}


def test_deep_validate_passes_and_names_a_corrupted_middle_slot(caches: tuple[Path, Path],
                                                                tmp_path: Path) -> None:
    """A spanning cache validates deep; values overwritten in the middle slot of a sample
    spanning three pass the shallow check, and --deep and the reader name that slot alone."""
    report = validate_cache(str(caches[0]), deep=True)
    assert report.problems == []
    assert report.checked["slots"] == sum(map(len, USED_ROWS.values()))
    cache = Path(shutil.copytree(caches[0], tmp_path / "c"))
    middle = _slots(open_cache(str(cache)), 0)[1]
    arr = zarr.open_group(str(cache), mode="r+")["aux_hidden.1"]
    rows = row_selection(SPEC, middle * 32, (middle + 1) * 32)
    arr[rows] = np.asarray(arr[rows]) ^ np.uint16(1)
    assert validate_cache(str(cache)).problems == []
    problems = validate_cache(str(cache), deep=True).problems
    assert len(problems) == 1, problems
    assert re.match(rf"unit 0, slot {middle}: array aux_hidden.1: crc32c .* != committed",
                    problems[0])
    with pytest.raises(ChecksumError, match=rf"unit 0, slot {middle}: array aux_hidden.1"):
        open_cache(str(cache)).read_sample(0)


def test_a_wrong_loss_count_of_a_spanning_sample_is_caught_by_deep(caches: tuple[Path, Path],
                                                                  tmp_path: Path) -> None:
    """--deep counts a spanning sample's loss tokens over all its slots."""
    cache = Path(shutil.copytree(caches[0], tmp_path / "c"))
    index = open_cache(str(cache)).samples
    start, length = int(index.row_offset[0]), int(index.length[0])
    arr = zarr.open_group(str(cache), mode="r+")["loss_mask"]
    arr[row_selection(SPEC, start, start + length)] = np.ones(length, np.uint8)
    problems = validate_cache(str(cache), deep=True).problems
    assert any(re.match(rf"unit 0, slot {start // 32 + 2}, sample 0: loss_mask has {length} "
                        rf"loss tokens but the commit record says {int(index.num_loss_tokens[0])}",
                        p) for p in problems), problems


def test_a_commit_record_missing_a_spanned_slot_is_refused(caches: tuple[Path, Path]) -> None:
    """A record that lists a spanning sample's first slot but not the next is refused, naming
    the sample."""
    data = json.loads((caches[0] / commit_key(SPEC, 0)).read_bytes())
    del data["slots"][1]
    with pytest.raises(ManifestError, match=r"'samples.length\[0\]': expected rows inside the "
                                            r"unit's slots"):
        parse_commit_columns(json.dumps(data).encode(), unit=0, spec=SPEC)


def _stored(root: Path) -> dict[str, bytes]:
    """Every array object and commit record of a cache, by path."""
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*"))
            if f.is_file() and ("/c/" in str(f) or "_commits" in str(f))}


def test_samples_streamed_in_blocks_store_what_whole_samples_store(
        caches: tuple[Path, Path], tmp_path: Path) -> None:
    """A unit streamed sample by sample in blocks of 7 rows (as a chunked capture hands them
    over), with a 70-row sample abandoned after 50 rows on its way (it filled a slot, written at
    once), stores the same array objects and commit records, byte for byte, as whole samples."""
    path = tmp_path / "streamed"
    w = CacheWriter.open(str(path), spec=SPEC, header=make_run_header(SPEC, num_units=2))
    for unit in LENGTHS:
        records, accounting = make_unit(SPEC, unit, lengths=LENGTHS[unit])
        stream = w.open_unit(unit)
        for i, record in enumerate(records):
            if (unit, i) == (0, 3):
                doomed = make_unit(SPEC, 0, lengths=[70] * 5, seed=9)[0][i]
                stream.begin(doomed.start())
                for lo in range(0, 50, 25):
                    stream.add(_rows(doomed, lo, lo + 25))
                stream.abandon()
            stream.begin(record.start())
            for lo in range(0, record.num_tokens, 7):
                stream.add(_rows(record, lo, lo + 7))
            stream.end()
        stream.commit(accounting)
    finalize_cache(str(path), expected_units=2)
    assert _stored(path) == _stored(caches[0])
    assert validate_cache(str(path), deep=True).problems == []


def _rows(record: SampleRecord, lo: int, hi: int) -> SampleRows:
    whole = record.rows()
    return SampleRows(aux_hidden=whole.aux_hidden[lo:hi], final_hidden=whole.final_hidden[lo:hi])


def test_a_crash_in_the_middle_of_a_sample_resumes_exactly_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer dies after two of the three slots of a sample landed: the unit stays
    uncommitted, a rerun writes it once in a fresh attempt, and the cache reads and validates
    as if the crash never happened."""
    real, written = UnitStream._write_slot, []

    def dying(self: UnitStream) -> Any:
        if len(written) == 2:
            raise OSError("killed")
        written.append(self._slot)
        return real(self)

    path = tmp_path / "c"
    w = CacheWriter.open(str(path), spec=SPEC, header=make_run_header(SPEC, num_units=2))
    monkeypatch.setattr(UnitStream, "_write_slot", dying)
    with pytest.raises(OSError, match="killed"):
        w.write_unit(0, *make_unit(SPEC, 0, lengths=LENGTHS[0]))
    monkeypatch.undo()
    assert w.committed_units() == set()
    _write(path, SPEC)
    reader = open_cache(str(path))
    assert int(reader.manifest.storage.totals.samples) == 8
    assert written[0] not in _slots(reader, 0)  # attempt 1 owns fresh slots
    for got, want in zip(reader.read_unit(0), _records(0), strict=True):
        _assert_same(got, want)
    assert validate_cache(str(path), deep=True).problems == []
