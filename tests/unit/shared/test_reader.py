"""Reader: checksum verification names the damage; tensors share memory with the arrays."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from cache_helpers import forge_rows, make_run_header, make_unit, reseal_slot_table, slot_object

from sparkforge.manifests.finalize import finalize_cache
from sparkforge.manifests.open import IndexMismatchError, open_cache
from sparkforge.shared.cache_tables import SlotColumns
from sparkforge.shared.layer_ids import LayerIdError
from sparkforge.shared.layout import CacheSpec, row_selection
from sparkforge.shared.reader import CacheDataError, ChecksumError
from sparkforge.shared.storage import IrregularObjectError
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
    slot = _slot(cache, 1)
    arr = zarr.open_array(str(cache / "final_hidden"), mode="r+")
    rows = row_selection(SPEC, slot * 64, slot * 64 + 64)
    data = arr[rows]
    data[3, 5] ^= 1
    arr[rows] = data
    with pytest.raises(ChecksumError, match=f"^unit 1, slot {slot}: array final_hidden: "
                                            "crc32c 0x[0-9a-f]{8} != committed 0x[0-9a-f]{8} "):
        open_cache(str(cache), verify=True).read_unit(1)
    assert len(open_cache(str(cache), verify=True).read_unit(0)) > 0


def test_lost_shard_object_is_detected(cache: Path) -> None:
    """A deleted shard (zarr would read zeros) is refused by unit and by sample reads."""
    reader = open_cache(str(cache), verify=False)
    slot = _slot(cache, 0)
    slot_object(cache, "aux_hidden.1", slot).unlink()
    with pytest.raises(CacheDataError, match=f"unit 0, slot {slot}: array aux_hidden.1: object "
                                             f"aux_hidden.1/c/0/{slot}/0 is missing"):
        reader.read_unit(0)
    sample = int(reader.samples.sample_id[reader.samples.of_unit(0)[0]])
    with pytest.raises(CacheDataError, match=r"aux_hidden\.1/c/.* is missing"):
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


@pytest.mark.parametrize("codec", ["lossless", "fp8"])
@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("features", [(0,), (1,), (2,), (0, 2), (1, 2)])
def test_feature_subset_equals_slicing_all_layers(tmp_path: Path, codec: str, verify: bool,
                                                  features: tuple[int, ...]) -> None:
    """Reading a subset of the captured features gives exactly those layers of a full read."""
    spec = CacheSpec(hidden_size=32, num_aux_layers=3, hidden_dtype="bfloat16", max_seq_len=24,
                     shard_rows=64, rows_per_unit=6, aux_codec=codec)  # type: ignore[arg-type]
    uri = str(tmp_path / "c")
    w = CacheWriter.open(uri, spec=spec, header=make_run_header(spec))
    w.write_unit(0, *make_unit(spec, 0))
    finalize_cache(uri, expected_units=1)
    whole = {s.sample_id: s for s in open_cache(uri).read_unit(0)}
    subset = open_cache(uri, verify=verify, features=features)
    positions = list(features)   # captured HF ids 1..3 = feature ids 0..2
    for s in subset.read_unit(0):
        np.testing.assert_array_equal(s.aux_hidden, whole[s.sample_id].aux_hidden[:, positions])
        np.testing.assert_array_equal(s.final_hidden, whole[s.sample_id].final_hidden)
    sid = next(iter(whole))
    np.testing.assert_array_equal(subset.read_sample(sid).aux_hidden,
                                  whole[sid].aux_hidden[:, positions])


def test_features_not_captured_are_refused(cache: Path) -> None:
    """Asking for a feature the cache lacks names it in both conventions."""
    with pytest.raises(LayerIdError, match=r"feature ids \[2\] \(HF indices \[3\]\) are not "
                                           r"captured; the cache holds HF indices \[1, 2\]"):
        open_cache(str(cache), features=(0, 2))


def _slot(cache: Path, unit: int) -> int:
    slots = open_cache(str(cache)).slots
    return int(slots.slot[slots.of_unit(unit)][0])


def _second_sample(cache: Path, unit: int) -> tuple[int, int, int]:
    """Sample id, slot and first row of the unit's second sample in storage order."""
    samples = open_cache(str(cache)).samples
    pos = samples.of_unit(unit)[1]
    return int(samples.sample_id[pos]), int(samples.slot[pos]), int(samples.row_offset[pos])


def _break_zstd_chunk(cache: Path, unit: int) -> str:
    path = slot_object(cache, "input_ids", _slot(cache, unit))
    data = bytearray(path.read_bytes())
    data[8:24] = b"\xff" * 16
    path.write_bytes(bytes(data))
    return "input_ids"


def _break_blosc_shard(cache: Path, unit: int) -> str:
    path = slot_object(cache, "final_hidden", _slot(cache, unit))
    data = bytearray(path.read_bytes())
    for i in range(20, 60):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    return "final_hidden"


def _delete_shard(cache: Path, unit: int) -> str:
    slot_object(cache, "aux_hidden.1", _slot(cache, unit)).unlink()
    return "aux_hidden.1"


def _fifo_shard(cache: Path, unit: int) -> str:
    """A FIFO where a shard was: open() on it would block until a writer comes, forever."""
    shard = slot_object(cache, "aux_hidden.1", _slot(cache, unit))
    shard.unlink()
    os.mkfifo(shard)
    return "aux_hidden.1"


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no_verify"])
@pytest.mark.parametrize("corrupt", [_break_zstd_chunk, _break_blosc_shard, _delete_shard,
                                     _fifo_shard],
                         ids=["zstd_chunk", "blosc_shard", "deleted_shard", "fifo_shard"])
def test_damaged_slot_is_refused_naming_unit_slot_and_array(cache: Path, corrupt: object,
                                                            verify: bool) -> None:
    """Missing or undecodable objects are refused, crc check or not, naming unit/slot/array."""
    name = corrupt(cache, 1)  # type: ignore[operator]
    slot = _slot(cache, 1)
    reader = open_cache(str(cache), verify=verify)
    with pytest.raises(CacheDataError, match=rf"^unit 1, slot {slot}: array {name}: "):
        reader.read_unit(1)
    assert len(reader.read_unit(0)) > 0


def test_checksums_are_verified_by_default(cache: Path) -> None:
    """open_cache verifies crc32c unless told not to."""
    assert open_cache(str(cache)).verify is True


def test_token_id_outside_the_vocabulary_names_the_sample(cache: Path) -> None:
    """An id >= vocab_size (with a matching crc) is refused naming unit, slot and sample."""
    sample_id, slot, row_offset = _second_sample(cache, 1)
    forge_rows(cache, "input_ids", row_offset + 1, np.array([5000], dtype=np.int32))
    reader = open_cache(str(cache))
    with pytest.raises(CacheDataError, match=rf"^unit 1, slot {slot}, sample {sample_id}: "
                                             r"input_ids outside \[0, target.vocab_size=1024\): "
                                             r"min \d+, max 5000$"):
        reader.read_unit(1)
    with pytest.raises(CacheDataError, match=f"sample {sample_id}: input_ids outside"):
        reader.read_sample(sample_id)


def test_loss_mask_value_other_than_0_or_1_names_the_sample(cache: Path) -> None:
    """A 2 in loss_mask (with a matching crc; --deep flags it too) is refused, not read as a
    double weight or ignored at a prompt position."""
    sample_id, slot, row_offset = _second_sample(cache, 1)
    forge_rows(cache, "loss_mask", row_offset, np.array([2], dtype=np.uint8))
    with pytest.raises(CacheDataError, match=rf"^unit 1, slot {slot}, sample {sample_id}: "
                                             r"loss_mask not 0 or 1: min 0, max 2$"):
        open_cache(str(cache)).read_unit(1)


def test_index_boundaries_must_match_the_commit_record(cache: Path) -> None:
    """A consistently re-sealed index with a moved boundary is refused at the unit's first read."""
    import hashlib
    import io
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(cache / "index.parquet")
    rows = table.to_pylist()
    mine = sorted((r for r in rows if r["unit"] == 1), key=lambda r: r["row_offset"])
    first, second = next((a, b) for a, b in zip(mine, mine[1:], strict=False)
                         if a["slot"] == b["slot"])
    first["length"] += 1
    second["length"] -= 1
    second["row_offset"] += 1
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), buf)
    (cache / "index.parquet").write_bytes(buf.getvalue())
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["storage"]["index_sha256"] = hashlib.sha256(buf.getvalue()).hexdigest()
    (cache / "manifest.json").write_text(json.dumps(manifest))
    reader = open_cache(str(cache))
    assert len(reader.read_unit(0)) > 0
    with pytest.raises(IndexMismatchError, match=rf"^unit 1: .* sample {first['sample_id']}: "
                                                 r"index.parquet has length = \d+, commit record"):
        reader.read_unit(1)


def test_slot_table_must_match_the_commit_record(cache: Path) -> None:
    """A re-sealed slot table whose crc32c of one slot differs from the unit's commit record is
    refused at the unit's first read, by the record check (ahead of the checksum's own error)."""
    def edit(slots: SlotColumns) -> None:
        k = slots.of_unit(1).start
        slots.crc32c[k, slots.arrays.index("input_ids")] ^= 1

    reseal_slot_table(cache, edit)
    reader = open_cache(str(cache))
    assert len(reader.read_unit(0)) > 0
    with pytest.raises(IndexMismatchError, match=r"^unit 1: .*slots: the manifest's crc32c "
                                                 r"differ from the commit record's"):
        reader.read_unit(1)


@pytest.mark.parametrize("key", ["zarr.json", "input_ids/zarr.json", "manifest.json",
                                 "_commits/0/unit_00000000.json"])
def test_special_file_as_a_cache_document_is_named_not_opened(cache: Path, key: str) -> None:
    """A FIFO as a metadata file, the manifest or a commit record: one line naming it (opening
    it would hang the reader)."""
    (cache / key).unlink()
    os.mkfifo(cache / key)
    with pytest.raises(IrregularObjectError, match=rf"^{re.escape(key)}: a FIFO \(named pipe\), "
                                                   r"not a regular file"):
        open_cache(str(cache)).read_unit(0)


def test_link_out_of_the_root_is_not_read(cache: Path, tmp_path: Path) -> None:
    """A shard replaced by a link to a file outside the cache is refused, not decoded."""
    outside = tmp_path / "outside"
    slot = _slot(cache, 0)
    shard = slot_object(cache, "aux_hidden.1", slot)
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(CacheDataError, match=rf"^unit 0, slot {slot}: array aux_hidden.1: "
                                             r"aux_hidden.1/c/0/\d+/0: a link to .*outside"):
        open_cache(str(cache)).read_unit(0)
