"""sparkforge validate: a valid cache passes; each corruption is reported with its own message."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr
from cache_helpers import (
    SMALL_FP8_SPEC,
    SMALL_SPEC,
    build_cache,
    cache_spec,
    make_run_header,
    make_unit,
    slot_object,
    unit_slots,
)

from sparkforge.app.cli import main
from sparkforge.manifests import index_check, index_rows
from sparkforge.manifests.finalize import finalize_cache
from sparkforge.manifests.objects import CacheNotFoundError
from sparkforge.manifests.validate import MAX_PROBLEM_CHARS, validate_cache
from sparkforge.shared.layout import CacheSpec, row_selection
from sparkforge.shared.writer import CacheWriter

SPEC, FP8 = SMALL_SPEC, SMALL_FP8_SPEC


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    data = _json(path)
    edit(data)
    path.write_text(json.dumps(data))


def _first_slot(cache: Path, unit: int = 0) -> int:
    return unit_slots(cache, unit)[0]


def _rewrite_index(cache: Path, edit: Callable[[list[dict]], list[dict]]) -> None:
    """Change index rows and re-seal the manifest's sha256 so only the row check can object."""
    table = pq.read_table(cache / "index.parquet")
    rows = edit(table.to_pylist())
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), buf)
    (cache / "index.parquet").write_bytes(buf.getvalue())
    _edit_json(cache / "manifest.json", lambda m: m["storage"].__setitem__(
        "index_sha256", hashlib.sha256(buf.getvalue()).hexdigest()))


def _delete_commit(c: Path) -> None:
    (c / "_commits/0/unit_00000001.json").unlink()


def _delete_shard(c: Path) -> None:
    slot_object(c, "aux_hidden.1", _first_slot(c, 2)).unlink()


def _delete_chunk(c: Path) -> None:
    slot_object(c, "input_ids", _first_slot(c)).unlink()


def _wrong_row_shape(c: Path) -> None:
    _edit_json(c / "aux_hidden.1/zarr.json", lambda z: z["shape"].__setitem__(-1, 8))


def _wrong_dtype(c: Path) -> None:
    _edit_json(c / "final_hidden/zarr.json", lambda z: z.__setitem__("data_type", "int16"))


def _tampered_crc(c: Path) -> None:
    _edit_json(c / "_commits/0/unit_00000000.json",
               lambda r: r["slots"][0]["crc32c"].__setitem__("loss_mask", 7))


def _tampered_accounting(c: Path) -> None:
    _edit_json(c / "_commits/0/unit_00000002.json",
               lambda r: r["accounting"].__setitem__("skipped", {"empty": 1}))


def _accounting_off(c: Path) -> None:
    def edit(m: dict) -> None:
        m["accounting"]["failed"] += 1
        m["accounting"]["input_rows"] += 1
    _edit_json(c / "manifest.json", edit)


def _index_length(c: Path) -> None:
    _rewrite_index(c, lambda rows: [r | {"length": r["length"] + 1} if i == 2 else r
                                    for i, r in enumerate(rows)])


def _index_extra_row(c: Path) -> None:
    _rewrite_index(c, lambda rows: [*rows, rows[-1] | {"sample_id": 99, "row_offset": 0}])


def _index_tampered(c: Path) -> None:
    (c / "index.parquet").write_bytes((c / "index.parquet").read_bytes() + b"x")


def _extra_commit(c: Path) -> None:
    (c / "_commits/0/unit_00000009.json").write_bytes(b"{}")


def _no_manifest(c: Path) -> None:
    (c / "manifest.json").unlink()


def _header_changed(c: Path) -> None:
    _edit_json(c / "_meta/header.json",
               lambda h: h["header"]["target"].__setitem__("model_type", "llama"))


def _logical_bytes_off(c: Path) -> None:
    _edit_json(c / "manifest.json",
               lambda m: m["storage"]["totals"].__setitem__("logical_bytes", 5))


def _codec_changed(c: Path) -> None:
    _edit_json(c / "manifest.json",
               lambda m: m["storage"]["codecs"].__setitem__("input_ids", "lz4"))


def _refinalize(c: Path, units: int) -> None:
    """Rebuild index and manifest from the commit records (a consistent edit of all three)."""
    (c / "manifest.json").unlink()
    finalize_cache(str(c), expected_units=units)


def _unit_dropped(c: Path) -> None:
    (c / "_commits/0/unit_00000002.json").unlink()
    _refinalize(c, 2)


def _no_train_samples(c: Path) -> None:
    for u in range(3):
        _edit_json(c / f"_commits/0/unit_{u:08d}.json", lambda r: r["samples"].__setitem__(
            "split", ["eval"] * len(r["samples"]["split"])))
    _refinalize(c, 3)


PARITY = {"num_samples": 4, "num_tokens": 311, "dtype": "float32",
          "layers": [{"name": "final (post-norm)", "max_abs": 4.8e-06, "rel": 5.2e-07}],
          "top1_agreement": 1.0, "kl_topk": 2.1e-09, "max_abs_logprob": 3.4e-06, "passed": True}


def _forged_parity(c: Path) -> None:
    _edit_json(c / "manifest.json", lambda m: m.__setitem__("parity", PARITY))


def _bare_parity(c: Path) -> None:
    _edit_json(c / "manifest.json", lambda m: m.__setitem__("parity", {"passed": True}))


def _huge_parity_string(c: Path) -> None:
    _edit_json(c / "manifest.json",
               lambda m: m.__setitem__("parity", PARITY | {"dtype": "x" * (100 << 20)}))


def _parity_file_differs(c: Path) -> None:
    _forged_parity(c)
    (c / "target").mkdir(exist_ok=True)
    (c / "target/parity.json").write_text(json.dumps(PARITY | {"passed": False}))


def _nest(path: Path, edit: Callable[[dict, str], None], depth: int) -> None:
    """Put a value nested ``depth`` lists deep into a JSON file (without recursing to build it)."""
    data = _json(path)
    edit(data, "__DEEP__")
    path.write_text(json.dumps(data).replace('"__DEEP__"', "[" * depth + "]" * depth))


def _deep_manifest(c: Path) -> None:
    _nest(c / "manifest.json", lambda m, v: m["producer_config"].__setitem__("x", v), 200_000)


def _moderately_deep_manifest(c: Path) -> None:
    _nest(c / "manifest.json", lambda m, v: m["producer_config"].__setitem__("x", v), 40)


def _deep_commit(c: Path) -> None:
    _nest(c / "_commits/0/unit_00000001.json", lambda r, v: r.__setitem__("samples", v), 200_000)


def _deep_header(c: Path) -> None:
    _nest(c / "_meta/header.json", lambda h, v: h["header"].__setitem__("data", v), 200_000)


def _commit_links_out(c: Path) -> None:
    outside = c.parent / "elsewhere.json"
    outside.write_bytes((c / "_commits/0/unit_00000001.json").read_bytes())
    (c / "_commits/0/unit_00000001.json").unlink()
    (c / "_commits/0/unit_00000001.json").symlink_to(outside)


def _shard_links_out(c: Path) -> None:
    shard = slot_object(c, "aux_hidden.1", _first_slot(c, 1))
    shard.unlink()
    shard.symlink_to("/etc/passwd")


def _fifo_shard(c: Path) -> None:
    shard = slot_object(c, "aux_hidden.1", _first_slot(c, 1))
    shard.unlink()
    os.mkfifo(shard)


def _fifo_commit(c: Path) -> None:
    (c / "_commits/0/unit_00000001.json").unlink()
    os.mkfifo(c / "_commits/0/unit_00000001.json")


def _fifo_array_metadata(c: Path) -> None:
    (c / "final_hidden/zarr.json").unlink()
    os.mkfifo(c / "final_hidden/zarr.json")


def _device_manifest(c: Path) -> None:
    (c / "manifest.json").unlink()
    (c / "manifest.json").symlink_to("/dev/zero")


CORRUPTIONS = [
    (_delete_commit, r"^unit 1: commit record _commits/0/unit_00000001.json is missing$"),
    (_delete_shard, r"^unit 2, slot \d+: object aux_hidden.1/c/0/\d+/0 is missing \(it would read"),
    (_delete_chunk, r"^unit 0, slot \d+: object input_ids/c/0/\d+ is missing"),
    (_wrong_row_shape, r"^array aux_hidden.1: row shape is \(8,\) but the manifest implies "
                       r"\(16,\)$"),
    (_wrong_dtype, r"^array final_hidden: dtype is 'int16' but the manifest implies 'uint16'$"),
    (_tampered_crc, r"^unit 0: slots.parquet slots = .* but the commit record has"),
    (_tampered_accounting, r"^unit 2: units.parquet accounting = .*too_long.* but "
                           r"the commit record has .*empty"),
    (_accounting_off, r"^units.parquet: the units' accounting add up to .*input_rows=15.*, the "
                      r"manifest records .*input_rows=16"),
    (_index_length, r"^index row sample \d+: length = \d+ but unit \d's commit record has \d+$"),
    (_index_extra_row, r"^index row sample 99: references data no listed unit's commit record"),
    (_index_tampered, r"^index index.parquet: sha256 [0-9a-f]+ != manifest"),
    (_extra_commit, r"^unit 9: has a commit record but the manifest does not list it"),
    (_no_manifest, r"^manifest: .*no manifest.json: the cache is incomplete.*\(3 unit commit "
                   r"records present\)$"),
    (_header_changed, r"^_meta/header.json vs manifest: header.target.model_type: store has "
                      r"'llama', manifest has 'qwen3'$"),
    (_logical_bytes_off, r"^manifest storage.totals.logical_bytes = 5 but tokens x row bytes = "
                         r"\d+$"),
    (_codec_changed, r"^array input_ids: codec is 'zstd-3' but the manifest implies 'lz4'$"),
    (_unit_dropped, r"^_meta/header.json promises producer_config.resolved.num_units = 3 units, "
                    r"but the manifest has 2 \(units lost after the run\?\)$"),
    (_unit_dropped, r"^_meta/header.json promises producer_config.resolved.num_rows = 15 input "
                    r"rows, but the manifest has 10 "),
    (_no_train_samples, r"^the cache's train split is empty$"),
    (_forged_parity, r"^manifest parity: reports a parity check \(passed=True\) but "
                     r"target/parity.json does not exist$"),
    (_bare_parity, r"^manifest: manifest field 'parity': expected keys \['dtype', 'kl_topk', .* "
                   r"\(missing\)"),
    (_huge_parity_string, r"^manifest: manifest field 'parity.dtype': expected a non-empty "
                          r"string of at most 32 characters, got 'xxxxx.{100,115}\.\.\. "),
    (_parity_file_differs, r"^manifest parity: differs from target/parity.json \(passed=False "
                           r"there\)"),
    (_deep_manifest, r"^manifest: manifest.json: JSON nested deeper than 32 levels "),
    (_moderately_deep_manifest, r"^manifest: manifest.json: JSON nested deeper than 32 levels "),
    (_deep_commit, r"^unit 1: commit record of unit 1: JSON nested deeper than 32 levels$"),
    (_deep_header, r"^_meta/header.json: _meta/header.json: JSON nested deeper than 32 levels$"),
    (_commit_links_out, r"^_commits/0/unit_00000001.json: a link to .*elsewhere.json, outside the "
                        r"cache root \(a cache holds its own objects; nothing behind it is "
                        r"read\)$"),
    (_commit_links_out, r"^unit 1: _commits/0/unit_00000001.json: a link to .*elsewhere.json, "
                        r"outside the cache root .*; refusing to read it$"),
    (_shard_links_out, r"^aux_hidden.1/c/0/\d+/0: a link to /etc/passwd, outside the cache root"),
    # special files: named, never opened (open() on a FIFO blocks forever)
    (_fifo_shard, r"^aux_hidden.1/c/0/\d+/0: a FIFO \(named pipe\), not a regular file \(never "
                  r"opened; replace it with the real file\)$"),
    (_fifo_commit, r"^_commits/0/unit_00000001.json: a FIFO \(named pipe\), not a regular file"),
    (_fifo_array_metadata, r"^final_hidden/zarr.json: a FIFO \(named pipe\), not a regular"),
    (_device_manifest, r"^manifest.json: a character device, not a regular file"),
]


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A fresh valid cache per test (corruptions edit it in place)."""
    return build_cache(tmp_path / "c")


@pytest.mark.parametrize("spec", [SPEC, FP8], ids=["lossless", "fp8_topk"])
def test_valid_cache_validates(tmp_path: Path, spec: CacheSpec,
                               capsys: pytest.CaptureFixture[str]) -> None:
    """A cache straight from the writer and finalize has no problem, shallow or deep (exit 0)."""
    c = build_cache(tmp_path / "c", spec)
    report = validate_cache(str(c), deep=True)
    assert report.problems == []
    assert report.checked["units"] == 3
    assert report.checked["samples"] == 12
    # ids, mask, final, one aux array per layer (F = 2); fp8 adds a scale per layer and top-k 2
    assert report.checked["objects"] == report.checked["slots"] * (9 if spec.topk else 5)
    assert main(["validate", str(c), "--deep"]) == 0
    assert "valid; checked" in capsys.readouterr().out


@pytest.mark.parametrize(("corrupt", "message"), CORRUPTIONS,
                         ids=[f"{c.__name__.strip('_')}-{i}" for i, (c, _) in
                              enumerate(CORRUPTIONS)])
def test_corruption_is_reported(cache: Path, corrupt: Callable[[Path], None], message: str,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """Each store/manifest corruption yields its own problem line and exit code 1."""
    corrupt(cache)
    problems = validate_cache(str(cache)).problems
    assert any(re.search(message, p) for p in problems), problems
    assert main(["validate", str(cache)]) == 1
    assert any(re.search(message, line) for line in capsys.readouterr().out.splitlines())


def test_overwritten_slot_is_caught_only_by_deep(cache: Path) -> None:
    """A zombie overwrite of a committed slot passes the shallow check; --deep names the crc."""
    slot = _first_slot(cache, 1)
    arr = zarr.open_group(str(cache), mode="r+")["input_ids"]
    rows = row_selection(cache_spec(cache), slot * 32, (slot + 1) * 32)
    arr[rows] = np.arange(32, dtype=np.int32)
    assert validate_cache(str(cache)).problems == []
    problems = validate_cache(str(cache), deep=True).problems
    assert any(re.match(rf"unit 1, slot {slot}: array input_ids: crc32c 0x[0-9a-f]{{8}} != "
                        r"committed 0x[0-9a-f]{8} \(data corrupted", p) for p in problems)


def test_flipped_bytes_in_a_shard_object_are_caught_by_deep(cache: Path) -> None:
    """Bytes flipped inside a stored shard file: --deep reports a crc mismatch or a decode error."""
    slot = _first_slot(cache, 0)
    path = slot_object(cache, "aux_hidden.1", slot)
    data = bytearray(path.read_bytes())
    for i in range(40, 60):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = validate_cache(str(cache), deep=True).problems
    assert any(re.match(rf"unit 0, slot {slot}: array aux_hidden.1: (crc32c .* != committed|"
                        r"cannot be decoded)", p) for p in problems), problems


@pytest.mark.parametrize("name", ["aux_hidden.1", "final_hidden"])
def test_nan_in_a_slot_names_unit_slot_sample_and_layer(cache: Path, name: str) -> None:
    """A NaN written through zarr is reported with unit, slot, sample, token (and layer slot)."""
    index = pq.read_table(cache / "index.parquet").to_pylist()
    sample = next(r for r in index if r["unit"] == 1 and r["length"] > 3)
    arr = zarr.open_group(str(cache), mode="r+")[name]
    row = row_selection(cache_spec(cache), sample["row_offset"] + 2, sample["row_offset"] + 3)
    value = np.asarray(arr[row])
    if name == "aux_hidden.1":
        value[0, 5] = 0x7FC0  # bf16 quiet NaN bits in the array of layer slot 1
    else:
        value[0, 3] = 0x7F80  # bf16 +inf
    arr[row] = value
    problems = validate_cache(str(cache), deep=True).problems
    layer = r" \(layer slots \[1\] = capture.layer_ids \[2\]\)" if name == "aux_hidden.1" else ""
    expected = (rf"unit 1, slot {sample['slot']}, sample {sample['sample_id']}: array {name}"
                rf"{layer}: 1 non-finite values, first at token 2$")
    assert any(re.match(expected, p) for p in problems), problems


def test_wrong_loss_token_count_is_caught_by_deep(cache: Path) -> None:
    """A loss mask that disagrees with the committed num_loss_tokens is named per sample."""
    sample = pq.read_table(cache / "index.parquet").to_pylist()[0]
    arr = zarr.open_group(str(cache), mode="r+")["loss_mask"]
    start = sample["row_offset"]
    rows = row_selection(cache_spec(cache), start, start + sample["length"])
    arr[rows] = np.ones(sample["length"], dtype=np.uint8)
    problems = validate_cache(str(cache), deep=True).problems
    assert any(f"sample {sample['sample_id']}: loss_mask has {sample['length']} loss tokens but "
               f"the commit record says {sample['num_loss_tokens']}" in p for p in problems)


def test_missing_path_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A cache path that does not exist raises CacheNotFoundError and exits 2."""
    with pytest.raises(CacheNotFoundError):
        validate_cache(str(tmp_path / "nope"))
    assert main(["validate", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["validate"], ["validate", "x", "--bogus"], ["validate", "{c}", "--storage_options", "{bad"],
    ["validate", "{c}", "--storage_options", "[1]"],
    ["validate", "{c}", "--against", "{c}/no.yaml"],
    ["nonsense"], ["plan", "--hidden_size", "8"],
])
def test_usage_errors_exit_2(cache: Path, argv: list[str]) -> None:
    """Bad command lines, options, JSON and config paths exit 2, never 1."""
    assert main([a.replace("{c}", str(cache)) for a in argv]) == 2


def test_json_output_shape(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints one object with valid, problems, uri, deep, against and checked."""
    assert main(["validate", str(cache), "--json", "--deep"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] is True
    assert out["problems"] == []
    assert out["deep"] is True
    assert set(out) == {"valid", "problems", "uri", "deep", "against", "checked"}
    assert out["checked"]["samples"] == 12
    _delete_commit(cache)
    assert main(["validate", str(cache), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] is False
    assert "unit 1: commit record _commits/0/unit_00000001.json is missing" in out["problems"]


def test_links_out_of_the_root_are_never_read(cache: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """--deep reports a shard linked to /etc/passwd and quotes none of its bytes."""
    _shard_links_out(cache)
    _commit_links_out(cache)
    assert main(["validate", str(cache), "--deep"]) == 1
    out = capsys.readouterr().out
    assert "root:" not in out
    assert "(deep)" in out


@pytest.mark.parametrize("corrupt", [_shard_links_out, _fifo_shard])
def test_a_reported_object_is_not_also_called_missing(cache: Path,
                                                      corrupt: Callable[[Path], None]) -> None:
    """A shard linked out of the root or replaced by a FIFO gets its own line only, not a wrong
    'missing (it would read back as zeros)' beside it; --deep does not open it."""
    corrupt(cache)
    problems = validate_cache(str(cache), deep=True).problems
    assert len(problems) == 1, problems
    assert "is missing" not in problems[0]


def test_directory_link_inside_the_root_is_followed_like_zarr_does(cache: Path) -> None:
    """A slot directory moved inside the cache and linked back is present, not 'missing'."""
    slot = slot_object(cache, "aux_hidden.1", _first_slot(cache, 0)).parent
    moved = cache / "aux_hidden.1/moved"
    slot.rename(moved)
    slot.symlink_to(moved, target_is_directory=True)
    assert validate_cache(str(cache), deep=True).problems == []


@pytest.mark.parametrize("size", [500_000, 10 << 20])
def test_a_huge_value_never_makes_a_huge_line(cache: Path, size: int,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A multi-megabyte string in the header is named, and every printed line stays short."""
    _edit_json(cache / "_meta/header.json",
               lambda h: h["header"]["producer_config"].__setitem__("model", "x" * size))
    problems = validate_cache(str(cache)).problems
    assert problems
    assert any("producer_config.model" in p for p in problems), problems
    assert main(["validate", str(cache)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= MAX_PROBLEM_CHARS


def _index_row_dropped(c: Path) -> None:
    _rewrite_index(c, lambda rows: rows[:4] + rows[5:])


@pytest.mark.parametrize(("corrupt", "message"), [
    (_index_length, r"^index row sample \d+: length = \d+ but unit \d's commit record has \d+$"),
    (_index_extra_row, r"^index row sample 99: references data no listed unit's commit record"),
    (_index_row_dropped, r"^unit 1, sample 5: in the commit record but missing from index"),
    (lambda c: None, None),
], ids=["length", "extra_row", "row_dropped", "valid"])
def test_index_is_compared_batch_by_batch(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                          corrupt: Callable[[Path], None],
                                          message: str | None) -> None:
    """With batches of 3 rows (12 samples: index and records each streamed in 4 batches, never
    held whole) validate reports what it reports with one batch: each difference once."""
    corrupt(cache)
    whole = validate_cache(str(cache)).problems
    monkeypatch.setattr(index_rows, "BATCH_ROWS", 3)
    monkeypatch.setattr(index_check, "BATCH_ROWS", 3)
    assert validate_cache(str(cache)).problems == whole
    assert sum(message is not None and bool(re.search(message, p)) for p in whole) == (
        message is not None), whole
    if message is None:
        assert whole == []


def test_sample_ids_not_rising_with_units_are_sorted_and_checked(tmp_path: Path) -> None:
    """Unit 0 holding the highest ids: finalize writes the index sorted, validate (which then
    reads the records a second time, sorted) finds no problem, and a tampered row is named."""
    w = CacheWriter.open(str(tmp_path / "c"), spec=SPEC, header=make_run_header(SPEC, num_units=3))
    for u in range(3):
        samples, acc = make_unit(SPEC, u)
        if u == 0:
            samples = [dataclasses.replace(s, sample_id=s.sample_id + 1000) for s in samples]
        w.write_unit(u, samples, acc)
    finalize_cache(str(tmp_path / "c"), expected_units=3)
    ids = pq.read_table(tmp_path / "c/index.parquet").column("sample_id").to_pylist()
    assert ids == sorted(ids)
    assert ids[-1] >= 1000
    assert validate_cache(str(tmp_path / "c"), deep=True).problems == []
    _index_length(tmp_path / "c")
    problems = validate_cache(str(tmp_path / "c")).problems
    assert re.match(r"index row sample 7: length = 14 but unit 1's commit record has 13$",
                    problems[0]), problems
    assert len(problems) == 2  # and the index's token total
