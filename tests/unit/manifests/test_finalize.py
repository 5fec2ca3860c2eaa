"""finalize_cache and open_cache: only complete, consistent caches become readable."""

from __future__ import annotations

import dataclasses
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cache_helpers import make_run_header, make_unit

from sparkforge.manifests import index_rows
from sparkforge.manifests.finalize import finalize_cache, read_run_header
from sparkforge.manifests.open import open_cache
from sparkforge.manifests.schema import CacheIncompleteError, ManifestError
from sparkforge.shared import storage
from sparkforge.shared.layout import HEADER_KEY, CacheSpec, commit_key, first_slot
from sparkforge.shared.records import UnitAccounting
from sparkforge.shared.writer import CacheWriter

SPEC = CacheSpec(hidden_size=16, num_aux_layers=1, hidden_dtype="float16", max_seq_len=16,
                 shard_rows=32, rows_per_unit=5)


def _cache(path: Path, units: list[int]) -> CacheWriter:
    w = CacheWriter.open(str(path), spec=SPEC, header=make_run_header(SPEC))
    for u in units:
        w.write_unit(u, *make_unit(SPEC, u))
    return w


def test_missing_units_are_listed(tmp_path: Path) -> None:
    """Finalize refuses while units are uncommitted and lists them."""
    _cache(tmp_path / "c", [0, 2])
    with pytest.raises(CacheIncompleteError, match="2 of 4 units are not committed yet: 1, 3"):
        finalize_cache(str(tmp_path / "c"), expected_units=4)


def test_unfinalized_cache_is_refused_by_open(tmp_path: Path) -> None:
    """open_cache refuses a store without a manifest, saying it is incomplete."""
    _cache(tmp_path / "c", [0])
    with pytest.raises(CacheIncompleteError, match="no manifest.json: the cache is incomplete"):
        open_cache(str(tmp_path / "c"))


def test_finalize_writes_sorted_index_and_is_idempotent(tmp_path: Path) -> None:
    """The index is sorted by sample_id, agrees with the accounting, and finalize is repeatable."""
    _cache(tmp_path / "c", [1, 0, 2])
    first = finalize_cache(str(tmp_path / "c"), expected_units=3)
    index = pq.read_table(tmp_path / "c/index.parquet")
    ids = index.column("sample_id").to_pylist()
    assert ids == sorted(ids)
    assert len(ids) == first.accounting.written == 12
    assert first.accounting.skipped == {"too_long": 3}
    assert finalize_cache(str(tmp_path / "c"), expected_units=3) == first
    assert first.git_sha is None or len(first.git_sha) == 40


def test_duplicate_sample_ids_across_units_are_named(tmp_path: Path) -> None:
    """The same sample id committed by two units is reported with both units."""
    w = _cache(tmp_path / "c", [0])
    samples, acc = make_unit(SPEC, 1)
    samples[0] = dataclasses.replace(samples[0], sample_id=0)
    w.write_unit(1, samples, acc)
    with pytest.raises(ManifestError, match=r"sample 0 in units \[0, 1\]"):
        finalize_cache(str(tmp_path / "c"), expected_units=2)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda r: r["samples"]["row_offset"].__setitem__(1, 0), r"samples.row_offset\[1\]"),
    (lambda r: r["samples"]["source_row"].__setitem__(0, 999), r"samples.source_row\[0\]"),
    (lambda r: r["slots"][0].__setitem__("num_rows", 1), "'slots'"),
    (lambda r: r.__setitem__("unit", 3), "'unit': expected 0"),
    (lambda r: r["accounting"].__setitem__("failed", 2), "!= input_rows"),
])
def test_tampered_commit_record_is_rejected(tmp_path: Path, edit: object, match: str) -> None:
    """A commit record inconsistent with its unit or slots stops finalize, naming the field."""
    _cache(tmp_path / "c", [0])
    path = tmp_path / "c/_commits/0/unit_00000000.json"
    record = json.loads(path.read_text())
    edit(record)  # type: ignore[operator]
    path.write_text(json.dumps(record))
    with pytest.raises(ManifestError, match=f"commit record of unit 0: .*{match}"):
        finalize_cache(str(tmp_path / "c"), expected_units=1)


def test_tampered_index_is_rejected(tmp_path: Path) -> None:
    """open_cache checks the index against the manifest's sha256."""
    _cache(tmp_path / "c", [0])
    finalize_cache(str(tmp_path / "c"), expected_units=1)
    index = tmp_path / "c/index.parquet"
    index.write_bytes(index.read_bytes() + b"x")
    with pytest.raises(ManifestError, match="index.parquet: sha256"):
        open_cache(str(tmp_path / "c"))


def test_units_with_no_written_samples_are_committed(tmp_path: Path) -> None:
    """A unit whose rows were all skipped or failed still commits and is counted."""
    w = _cache(tmp_path / "c", [0])
    w.write_unit(1, [], UnitAccounting(input_rows=2, written=0, skipped={"empty": 1}, failed=1))
    manifest = finalize_cache(str(tmp_path / "c"), expected_units=2)
    assert manifest.accounting.failed == 1
    assert manifest.accounting.input_rows == SPEC.rows_per_unit + 2
    assert open_cache(str(tmp_path / "c"), verify=True).read_unit(1) == []


def test_run_header_with_wrong_keys_names_the_file_and_the_keys(tmp_path: Path) -> None:
    """A run header missing a key is refused with its path and the keys it does have."""
    _cache(tmp_path / "c", [])
    path = tmp_path / "c" / HEADER_KEY
    data = json.loads(path.read_text())
    del data["spec"]
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"header\.json: expected .* got \['format_version', "
                                            r"'header'\]"):
        read_run_header(storage.open_location(str(tmp_path / "c")))


def test_parity_report_reaches_the_manifest_only_when_written(tmp_path: Path) -> None:
    """target/parity.json, when the producer wrote one, is copied into the manifest verbatim."""
    report = {"num_samples": 2, "num_tokens": 40, "dtype": "float32",
              "layers": [{"name": "final", "max_abs": 1e-6, "rel": 2e-7, "dtype_noise": None}],
              "top1_agreement": 1.0, "kl_topk": 0.0, "max_abs_logprob": 1e-6, "passed": True,
              "num_image_samples": 1}
    _cache(tmp_path / "with", [0]).write_target_files({"parity.json": json.dumps(report).encode()})
    _cache(tmp_path / "without", [0])
    assert finalize_cache(str(tmp_path / "with"), expected_units=1).to_json()["parity"] == report
    assert finalize_cache(str(tmp_path / "without"), expected_units=1).parity is None


def test_malformed_parity_report_is_refused_naming_the_field(tmp_path: Path) -> None:
    """A parity.json that is not a full report fails finalize naming the missing keys."""
    _cache(tmp_path / "c", [0]).write_target_files(
        {"parity.json": json.dumps({"passed": True}).encode()})
    with pytest.raises(ManifestError, match=r"manifest field 'parity': expected keys \['dtype'"):
        finalize_cache(str(tmp_path / "c"), expected_units=1)


def _copied_units(path: Path, num_units: int) -> None:
    """A cache of ``num_units`` units of 256 four-token samples: unit 0 by the real writer, the
    others its commit record with shifted ids (no slot objects: finalize reads only records)."""
    spec = CacheSpec(hidden_size=1, num_aux_layers=1, hidden_dtype="bfloat16", max_seq_len=4,
                     shard_rows=128, rows_per_unit=256)
    w = CacheWriter.open(str(path), spec=spec, header=make_run_header(spec))
    w.write_unit(0, *make_unit(spec, 0, skip_every=1 << 20))
    record = json.loads((path / commit_key(spec, 0)).read_text())
    base = np.asarray(record["samples"]["row_offset"]) - first_slot(spec, 0, 0) * 128
    for unit in range(1, num_units):
        first, ids = first_slot(spec, unit, 0), list(range(unit * 256, (unit + 1) * 256))
        record.update(unit=unit, slots=[dict(s, slot=first + k)
                                        for k, s in enumerate(json.loads(
                                            (path / commit_key(spec, 0)).read_text())["slots"])])
        record["samples"].update(
            sample_id=ids, source_row=ids, slot=[first + o // 128 for o in base.tolist()],
            row_offset=(first * 128 + base).tolist())
        (path / commit_key(spec, unit)).write_text(json.dumps(record))


def test_finalize_memory_does_not_grow_with_the_samples(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Finalize streams the index (here in batches of 2,048 rows): 20 and 200 units (5,120 and
    51,200 samples) peak within 16 bytes per added sample, in Python/numpy memory and in Arrow's
    pool (holding the index, as before, cost ~150 bytes per sample)."""
    monkeypatch.setattr(index_rows, "BATCH_ROWS", 2048)
    peaks = []
    for units in (20, 200):
        _copied_units(tmp_path / str(units), units)
        tracemalloc.start()
        # One record at a time: each local read first allocates MAX_COMMIT_BYTES (untouched
        # pages, yet traced), which would make the peak depend on how many reads overlap.
        finalize_cache(str(tmp_path / str(units)), expected_units=units, max_concurrency=1)
        peaks.append((tracemalloc.get_traced_memory()[1], pa.default_memory_pool().max_memory()))
        tracemalloc.stop()
    added = (200 - 20) * 256
    assert (peaks[1][0] - peaks[0][0]) / added < 16, peaks
    assert (peaks[1][1] - peaks[0][1]) / added < 16, peaks
    index = pq.read_table(tmp_path / "200/index.parquet")
    assert index.column("sample_id").to_pylist() == list(range(200 * 256))
    assert pq.ParquetFile(tmp_path / "200/index.parquet").metadata.num_row_groups == 25
