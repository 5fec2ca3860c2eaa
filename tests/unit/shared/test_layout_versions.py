"""Formats 2-4 store one array per captured layer, so a subset read takes only its layers'
bytes; format 3 nests slot objects under slot groups, format 4 commit records and attempt claims
too; format 1 caches (every layer in one array), format 2 caches (flat slot keys) and format 3
caches (flat ``_commits/``) still read, exactly as before."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import zarr
from cache_helpers import counting_reads, make_run_header, make_unit

from sparkforge.manifests.finalize import finalize_cache
from sparkforge.manifests.open import open_cache
from sparkforge.manifests.validate import validate_cache
from sparkforge.shared.dtypes import (
    dequantize_e4m3,
    float_to_storage,
    quantize_e4m3,
    storage_to_float32,
)
from sparkforge.shared.layout import (
    FORMAT_VERSION,
    GROUP_SLOTS,
    MAX_ATTEMPTS,
    MAX_UNITS,
    UNITS_PER_GROUP,
    CacheSpec,
    row_selection,
    slots_per_attempt,
    units_per_group,
)
from sparkforge.shared.writer import CacheMismatchError, CacheWriter

SPEC = CacheSpec(hidden_size=256, num_aux_layers=4, hidden_dtype="bfloat16", max_seq_len=24,
                 shard_rows=64, rows_per_unit=6)


def _write(path: Path, spec: CacheSpec, units: int = 2) -> str:
    uri = str(path)
    w = CacheWriter.open(uri, spec=spec, header=make_run_header(spec))
    for unit in range(units):
        w.write_unit(unit, *make_unit(spec, unit))
    finalize_cache(uri, expected_units=units)
    return uri


def _aux_bytes_read(uri: str, features: tuple[int, ...] | None) -> dict[str, int]:
    """Bytes each aux array gave the reader while it read every unit (crc32c on)."""
    with counting_reads() as stores:
        reader = open_cache(uri, features=features)
        for unit in reader.unit_ids().tolist():
            reader.read_unit(unit)
    total: dict[str, int] = {}
    for store in stores:
        for name, n in store.bytes_by_array.items():
            if name.startswith("aux_hidden"):
                total[name] = total.get(name, 0) + n
    return total


def test_new_caches_get_format_4() -> None:
    """The writer's default layout is the per-layer one with slot and bookkeeping groups."""
    assert FORMAT_VERSION == 4 == SPEC.format_version


@pytest.mark.parametrize("features", [(0,), (2,), (1, 3), (0, 1, 3), (0, 1, 2, 3)])
def test_bytes_read_scale_with_the_subset(tmp_path: Path, features: tuple[int, ...]) -> None:
    """Format 2: a run reads only its layers' arrays, each as many bytes as a full read takes."""
    uri = _write(tmp_path / "c", SPEC)
    full = _aux_bytes_read(uri, None)
    subset = _aux_bytes_read(uri, features)
    assert sorted(full) == [f"aux_hidden.{k}" for k in range(4)]
    assert subset == {f"aux_hidden.{k}": full[f"aux_hidden.{k}"] for k in features}
    share = sum(subset.values()) / sum(full.values())
    assert share == pytest.approx(len(features) / 4, abs=0.03)


def test_format_1_subset_reads_every_layer(tmp_path: Path) -> None:
    """Format 1 holds all layers in one chunk, so a 1-of-4 read still takes all aux bytes."""
    uri = _write(tmp_path / "c", dataclasses.replace(SPEC, format_version=1))
    assert _aux_bytes_read(uri, (0,)) == _aux_bytes_read(uri, None)


@pytest.mark.parametrize("codec", ["lossless", "fp8"])
@pytest.mark.parametrize("version", [1, 2, 3, 4])
@pytest.mark.parametrize("features", [None, (2,), (3, 0)])
def test_both_formats_read_back_what_was_written(tmp_path: Path, codec: str, version: int,
                                                 features: tuple[int, ...] | None) -> None:
    """Every sample of a format-1 to -4 cache reads back as written, in the asked order."""
    spec = dataclasses.replace(SPEC, aux_codec=codec, format_version=version)
    uri = _write(tmp_path / "c", spec)
    written = {s.sample_id: s for u in range(2) for s in make_unit(spec, u)[0]}
    layers = list(range(4)) if features is None else list(features)
    reader = open_cache(uri, features=features)
    assert reader.manifest.format_version == version
    read = [s for u in reader.unit_ids().tolist() for s in reader.read_unit(u)]
    assert sorted(s.sample_id for s in read) == sorted(written)
    for s in read:
        w = written[s.sample_id]
        aux = w.aux_hidden
        if codec == "fp8":  # the numpy reference round trip of the codes the writer stored
            codes, scales = quantize_e4m3(storage_to_float32(aux, "bfloat16"))
            aux = float_to_storage(dequantize_e4m3(codes, scales), "bfloat16")
        np.testing.assert_array_equal(s.aux_hidden, aux[:, layers])
        np.testing.assert_array_equal(s.final_hidden, w.final_hidden)
        np.testing.assert_array_equal(s.input_ids, w.input_ids)


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_both_formats_validate_deep(tmp_path: Path, version: int) -> None:
    """validate --deep finds nothing wrong in an intact cache of any format."""
    uri = _write(tmp_path / "c", dataclasses.replace(SPEC, format_version=version))
    report = validate_cache(uri, deep=True)
    assert report.problems == []
    arrays = 3 + (1 if version == 1 else 4)   # ids, mask, final + aux
    assert report.checked["objects"] == arrays * report.checked["slots"] > 0


def test_format_1_arrays_are_the_old_layout(tmp_path: Path) -> None:
    """Format 1 keeps aux_hidden [N, F, H] with (c, F, H) chunks; format 2 splits it by layer."""
    old = tmp_path / "v1"
    _write(old, dataclasses.replace(SPEC, format_version=1), units=1)
    new = tmp_path / "v2"
    _write(new, dataclasses.replace(SPEC, format_version=2), units=1)
    aux = zarr.open_array(str(old / "aux_hidden"), mode="r")
    assert (aux.shape[1:], aux.chunks, aux.shards) == ((4, 256), (64, 4, 256), (64, 4, 256))
    assert json.loads((old / "manifest.json").read_text())["format_version"] == 1
    for k in range(4):
        layer = zarr.open_array(str(new / f"aux_hidden.{k}"), mode="r")
        assert (layer.shape[1:], layer.chunks, layer.shards) == ((256,), (64, 256), (64, 256))
    assert not (new / "aux_hidden").exists()


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_older_store_is_not_resumed_as_format_4(tmp_path: Path, version: int) -> None:
    """A producer run cannot add format-4 units to an older cache; the error says what to do."""
    old = dataclasses.replace(SPEC, format_version=version)
    CacheWriter.open(str(tmp_path / "c"), spec=old, header=make_run_header(old))
    with pytest.raises(CacheMismatchError, match=f"has format_version {version} and this run "
                                                 "writes 4: finish it with the sparkforge that "
                                                 "started it"):
        CacheWriter.open(str(tmp_path / "c"), spec=SPEC, header=make_run_header(SPEC))


@pytest.mark.parametrize("version", [3, 4])
def test_formats_3_and_4_nest_slot_objects_under_slot_groups(tmp_path: Path,
                                                              version: int) -> None:
    """Format 3 arrays gain a leading group axis: a slot's object is c/{group}/{slot in group},
    so the c/ folder holds one entry per 1,000 units and a group folder their slots only."""
    spec = dataclasses.replace(SPEC, format_version=version)
    uri = _write(tmp_path / "c", spec, units=2)
    per_group = UNITS_PER_GROUP * MAX_ATTEMPTS * SPEC.rows_per_unit
    slots = open_cache(uri).slots.slot.tolist()
    layer = zarr.open_array(str(tmp_path / "c/aux_hidden.0"), mode="r")
    assert (layer.shape[0], layer.shards) == (MAX_UNITS // UNITS_PER_GROUP, (1, 64, 256))
    assert sorted(p.name for p in (tmp_path / "c/aux_hidden.0/c").iterdir()) == ["0"]
    assert sorted(int(p.name) for p in (tmp_path / "c/aux_hidden.0/c/0").iterdir()) == \
        sorted(s % per_group for s in slots)
    assert all((tmp_path / f"c/input_ids/c/{s // per_group}/{s % per_group}").is_file()
               for s in slots)


def test_one_helper_addresses_rows_in_every_format() -> None:
    """row_selection maps a slot's absolute rows onto each format's grid: flat before format 3,
    (group, rows inside the group) from it."""
    flat = dataclasses.replace(SPEC, format_version=2)
    group_rows = UNITS_PER_GROUP * MAX_ATTEMPTS * SPEC.rows_per_unit * SPEC.shard_rows
    start = 3 * group_rows + 5 * SPEC.shard_rows
    assert row_selection(flat, start, start + 7) == (slice(start, start + 7),)
    assert row_selection(SPEC, start, start + 7) == (3, slice(5 * 64, 5 * 64 + 7))


@pytest.mark.parametrize(("version", "commit", "attempt"), [
    (3, "_commits/unit_00000001.json", "_attempts/unit_00000001/0000"),
    (4, "_commits/0/unit_00000001.json", "_attempts/0/unit_00000001/0000")])
def test_format_4_nests_commit_records_and_claims_under_unit_groups(
        tmp_path: Path, version: int, commit: str, attempt: str) -> None:
    """Format 4 puts a unit's commit record and attempt claims in its group's folder; a format-3
    cache keeps them flat, and its readers still find them there (finalize, validate, resume)."""
    spec = dataclasses.replace(SPEC, format_version=version)
    uri = _write(tmp_path / "c", spec, units=2)
    assert (tmp_path / "c" / commit).is_file()
    assert (tmp_path / "c" / attempt).is_file()
    assert sorted(p.name for p in (tmp_path / "c/_commits").iterdir()) == (
        ["unit_00000000.json", "unit_00000001.json"] if version == 3 else ["0"])
    assert validate_cache(uri).problems == []
    writer = CacheWriter.open(uri, spec=spec, header=make_run_header(spec))
    assert writer.committed_units() == {0, 1}
    (tmp_path / "c" / commit).rename(tmp_path / "c/_commits" / Path(commit).name
                                     if version == 4 else tmp_path / "c/unit_00000001.json")
    assert writer.committed_units() == {0}  # a record away from its key is not the unit's


def test_format_4_groups_hold_at_most_group_slots() -> None:
    """A format-4 group holds as many units as keep its slots within GROUP_SLOTS when every
    attempt uses all its slots; format 3's always held 1,000 units."""
    def spec(rows: int, version: int = 4, **kw: int) -> CacheSpec:
        return dataclasses.replace(SPEC, rows_per_unit=rows, format_version=version, **kw)
    assert [units_per_group(spec(rows)) for rows in (6, 100, 101, 256, 100_000, 1 << 20)] == \
        [1000, 1000, 990, 390, 1, 1]
    assert units_per_group(spec(256, max_seq_len=128)) == 195  # 2 slots per sample
    assert units_per_group(spec(256, version=3)) == UNITS_PER_GROUP
    assert all(units_per_group(s) * slots_per_attempt(s) <= GROUP_SLOTS
               for s in (spec(r) for r in (6, 101, 256, 4096, 100_000)))
