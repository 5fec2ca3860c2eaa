"""The commit protocol: exactly once, zombie fencing, spec checks on reopen, bad samples."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zarr
from cache_helpers import make_header, make_run_header, make_unit

from sparkforge.manifests.finalize import finalize_cache
from sparkforge.manifests.open import open_cache
from sparkforge.shared.header import RunHeader
from sparkforge.shared.layout import CacheSpec, first_slot
from sparkforge.shared.writer import CacheMismatchError, CacheWriter, UnitAlreadyCommitted

SPEC = CacheSpec(hidden_size=32, num_aux_layers=2, hidden_dtype="bfloat16", max_seq_len=24,
                 shard_rows=64, rows_per_unit=6)


def _writer(path: Path, spec: CacheSpec = SPEC) -> CacheWriter:
    return CacheWriter.open(str(path), spec=spec, header=make_run_header(spec))


def test_unit_committed_twice_is_refused(tmp_path: Path) -> None:
    """A second write of a committed unit raises UnitAlreadyCommitted and changes nothing."""
    w = _writer(tmp_path / "c")
    w.write_unit(0, *make_unit(SPEC, 0))
    before = (tmp_path / "c/_commits/0/unit_00000000.json").read_bytes()
    with pytest.raises(UnitAlreadyCommitted, match="unit 0"):
        w.write_unit(0, *make_unit(SPEC, 0, seed=1))
    assert w.committed_units() == {0}
    assert (tmp_path / "c/_commits/0/unit_00000000.json").read_bytes() == before


def test_zombie_attempt_cannot_clobber_committed_slots(tmp_path: Path) -> None:
    """A stale writer that started before the commit writes only its own slots and loses."""
    winner, zombie = _writer(tmp_path / "c"), _writer(tmp_path / "c")
    stream = zombie.open_unit(0)  # the zombie claimed first, then stalled
    winner.write_unit(0, *make_unit(SPEC, 0))
    other, accounting = make_unit(SPEC, 0, seed=7)
    zombie_slot = first_slot(SPEC, 0, stream.attempt)
    for sample in other:  # it wakes up and writes its slots
        stream.begin(sample.start())
        stream.add(sample.rows())
        stream.end()
    with pytest.raises(UnitAlreadyCommitted):
        stream.commit(accounting)
    with pytest.raises(UnitAlreadyCommitted):
        zombie.write_unit(0, *make_unit(SPEC, 0, seed=7))
    finalize_cache(str(tmp_path / "c"), expected_units=1)
    reader = open_cache(str(tmp_path / "c"), verify=True)
    assert zombie_slot not in reader.slots.slot[reader.slots.of_unit(0)].tolist()
    expected, _ = make_unit(SPEC, 0)
    for got, want in zip(reader.read_unit(0), expected, strict=True):
        np.testing.assert_array_equal(got.aux_hidden, want.aux_hidden)


def test_reopen_with_different_spec_names_each_field(tmp_path: Path) -> None:
    """Reopening with another spec or header lists every differing dotted field and both values."""
    _writer(tmp_path / "c")
    spec = dataclasses.replace(SPEC, hidden_size=64)
    header = make_header(spec)
    header["target"]["vocab_size"] = 2048
    with pytest.raises(CacheMismatchError) as err:
        CacheWriter.open(str(tmp_path / "c"), spec=spec, header=RunHeader.from_json(header))
    text = str(err.value)
    assert "spec.hidden_size: store has 32, got 64" in text
    assert "header.target.vocab_size: store has 1024, got 2048" in text
    assert "header.target.hidden_size" in text


def test_reopen_with_same_spec_resumes(tmp_path: Path) -> None:
    """Reopening with the same spec sees the committed units."""
    _writer(tmp_path / "c").write_unit(1, *make_unit(SPEC, 1))
    assert _writer(tmp_path / "c").committed_units() == {1}


@pytest.mark.parametrize(("make", "key"), [
    (lambda path: zarr.open_group(path, mode="w", zarr_format=2), ".zgroup"),
    (lambda path: zarr.create_array(path, shape=(4,), dtype="int32", zarr_format=2), ".zarray"),
])
def test_a_zarr_v2_store_is_refused_before_anything_is_written(
        tmp_path: Path, make: Callable[[str], object], key: str) -> None:
    """A folder holding a zarr v2 group or array and no header is not a cache (every cache is a
    zarr v3 group): the writer names the v2 key and leaves the folder as it was, where it would
    put a v3 group beside the v2 one."""
    make(str(tmp_path / "c"))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(CacheMismatchError, match=rf"holds zarr v2 metadata \({key}\)"):
        _writer(tmp_path / "c")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_the_writer_creates_zarr_v3_whatever_zarrs_default_format(tmp_path: Path) -> None:
    """Under zarr's ``default_zarr_format: 2`` (``ZARR_DEFAULT_ZARR_FORMAT=2``) the writer
    still creates a v3 group and arrays, which a reader opens without that setting."""
    with zarr.config.set({"default_zarr_format": 2}):
        _writer(tmp_path / "c").write_unit(0, *make_unit(SPEC, 0))
    assert (tmp_path / "c/zarr.json").is_file()
    assert not list((tmp_path / "c").rglob(".z*"))
    finalize_cache(str(tmp_path / "c"), expected_units=1)
    expected, _ = make_unit(SPEC, 0)
    got = open_cache(str(tmp_path / "c")).read_unit(0)
    for have, want in zip(got, expected, strict=True):
        np.testing.assert_array_equal(have.final_hidden, want.final_hidden)


@pytest.mark.parametrize(("change", "match"), [
    ({"aux_hidden": np.zeros((3, 2, 32), np.float32)}, "aux_hidden must be"),
    ({"input_ids": np.zeros(3, np.int64)}, "input_ids must be"),
    ({"source_row": 99}, "source_row 99 outside"),
    ({"source_hash": "XYZ"}, "source_hash must be"),
    ({"split": "test"}, "split must be"),
])
def test_bad_sample_is_named(tmp_path: Path, change: dict, match: str) -> None:
    """A sample that does not fit the spec or unit is rejected naming unit, sample and field."""
    samples, acc = make_unit(SPEC, 0)
    samples[1] = dataclasses.replace(samples[1], **change)
    with pytest.raises(ValueError, match=f"unit 0, sample {samples[1].sample_id}: .*{match}"):
        _writer(tmp_path / "c").write_unit(0, samples, acc)


def test_too_long_sample_is_refused(tmp_path: Path) -> None:
    """Samples longer than max_seq_len are refused (they could not fit a slot)."""
    samples, acc = make_unit(SPEC, 0)
    t = 25
    long = dataclasses.replace(
        samples[0], input_ids=np.zeros(t, np.int32), loss_mask=np.zeros(t, np.uint8),
        aux_hidden=np.zeros((t, 2, 32), np.uint16), final_hidden=np.zeros((t, 32), np.uint16))
    with pytest.raises(ValueError, match="length 25 must be in"):
        _writer(tmp_path / "c").write_unit(0, [long, *samples[1:]], acc)
