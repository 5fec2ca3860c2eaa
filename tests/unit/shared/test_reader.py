"""Reader: checksum verification names the damage; tensors share memory with the arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from cache_helpers import make_run_header, make_unit

from sparkforge.manifests.finalize import finalize_cache
from sparkforge.manifests.open import open_cache
from sparkforge.shared.layout import CacheSpec
from sparkforge.shared.reader import ChecksumError
from sparkforge.shared.writer import CacheWriter

SPEC = CacheSpec(hidden_size=32, num_aux_layers=2, hidden_dtype="bfloat16", max_seq_len=24,
                 shard_rows=64, rows_per_unit=6)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A finalized two-unit cache."""
    w = CacheWriter.open(str(tmp_path / "c"), spec=SPEC, header=make_run_header(SPEC))
    for unit in range(2):
        w.write_unit(unit, *make_unit(SPEC, unit))
    finalize_cache(str(tmp_path / "c"), expected_units=2)
    return tmp_path / "c"


def test_overwritten_shard_is_detected(cache: Path) -> None:
    """Data changed after commit fails verification naming unit, slot and array."""
    slot = open_cache(str(cache)).units()[1].slots[0]
    arr = zarr.open_array(str(cache / "final_hidden"), mode="r+")
    rows = slice(slot.slot * 64, slot.slot * 64 + 64)
    data = arr[rows]
    data[3, 5] ^= 1
    arr[rows] = data
    with pytest.raises(ChecksumError, match=f"unit 1, slot {slot.slot}, array 'final_hidden'"):
        open_cache(str(cache), verify=True).read_unit(1)
    assert len(open_cache(str(cache), verify=True).read_unit(0)) > 0


def test_lost_shard_object_is_detected(cache: Path) -> None:
    """A deleted shard reads back as zeros in zarr; verification catches it."""
    reader = open_cache(str(cache), verify=True)
    slot = reader.units()[0].slots[0].slot
    (cache / f"aux_hidden/c/{slot}/0/0").unlink()
    with pytest.raises(ChecksumError, match=f"unit 0, slot {slot}, array 'aux_hidden'"):
        reader.read_unit(0)
    sample = reader.units()[0].samples[0].sample_id
    with pytest.raises(ChecksumError, match="aux_hidden"):
        reader.read_sample(sample)


def test_to_torch_is_zero_copy_bf16(cache: Path) -> None:
    """to_torch shares memory with the numpy arrays and restores bfloat16 values."""
    sample = open_cache(str(cache)).read_sample(2)
    tensors = sample.to_torch()
    assert tensors["aux_hidden"].dtype == torch.bfloat16
    assert tensors["aux_hidden"].data_ptr() == sample.aux_hidden.ctypes.data
    assert tensors["input_ids"].data_ptr() == sample.input_ids.ctypes.data
    widened = (sample.final_hidden.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(tensors["final_hidden"].float().numpy(), widened)


def test_read_sample_matches_read_unit(cache: Path) -> None:
    """Random access and whole-unit reads return the same sample."""
    reader = open_cache(str(cache))
    by_unit = {s.sample_id: s for s in reader.read_unit(1)}
    for sid, s in by_unit.items():
        one = reader.read_sample(sid)
        np.testing.assert_array_equal(one.aux_hidden, s.aux_hidden)
        assert one.split == s.split


def test_memory_uri_round_trip() -> None:
    """A memory:// cache (zarr FsspecStore over a sync filesystem) writes, finalizes and reads."""
    uri = "memory://reader-round-trip"
    w = CacheWriter.open(uri, spec=SPEC, header=make_run_header(SPEC))
    samples, acc = make_unit(SPEC, 0)
    w.write_unit(0, samples, acc)
    w.write_target_files({"config.json": b"{}"})
    finalize_cache(uri, expected_units=1)
    reader = open_cache(uri, verify=True)
    got = reader.read_unit(0)
    assert [s.sample_id for s in got] == [s.sample_id for s in samples]
    np.testing.assert_array_equal(got[-1].final_hidden, samples[-1].final_hidden)
    assert reader.target_file("config.json") == b"{}"
    with pytest.raises(ValueError, match="escapes the cache root"):
        reader.target_file("../../etc/passwd")
