"""sparkforge inspect: every number agrees with a hand count over the store's files."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from cache_helpers import (
    SMALL_FP8_SPEC,
    SMALL_SPEC,
    build_cache,
    make_unit,
    slot_object,
    unit_slots,
)

from sparkforge.app.cli import main
from sparkforge.manifests.summary import summarize_cache
from sparkforge.shared.layout import CacheSpec, array_layouts


@pytest.mark.parametrize("spec", [SMALL_SPEC, SMALL_FP8_SPEC], ids=["lossless", "fp8_topk"])
def test_inspect_numbers_match_a_hand_count(tmp_path: Path, spec: CacheSpec,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Samples, tokens, splits, skips, bytes on disk, ratio and bytes/token from the files."""
    cache = build_cache(tmp_path / "c", spec)
    samples = [s for u in range(3) for s in make_unit(spec, u)[0]]
    tokens = sum(s.num_tokens for s in samples)
    files = [p for p in cache.rglob("*") if p.is_file()]
    on_disk = sum(p.stat().st_size for p in files)
    slots = pq.read_table(cache / "slots.parquet")["slot"].to_pylist()
    layouts = array_layouts(spec)
    stored = {name: sum((cache / name / "c" / "0" / str(slot)).joinpath(  # group 0
        *["0"] * len(a.row_shape)).stat().st_size for slot in slots)
        for name, a in layouts.items()}
    logical = {name: tokens * a.dtype.itemsize * max(1, _prod(a.row_shape))
               for name, a in layouts.items()}

    s = summarize_cache(str(cache))
    assert (s["samples"], s["tokens"], s["units"], s["shards"]) == (12, tokens, 3, len(slots))
    assert s["objects"] == len(files)
    assert s["bytes_on_disk"] == on_disk
    assert s["bytes_per_token"] == pytest.approx(on_disk / tokens)
    assert s["data_bytes"] == sum(stored.values())
    assert s["compression_ratio"] == pytest.approx(sum(logical.values()) / sum(stored.values()))
    for name in layouts:
        assert s["arrays"][name]["stored_bytes"] == stored[name]
        assert s["arrays"][name]["logical_bytes"] == logical[name]
    assert s["splits"]["eval"]["samples"] == sum(s_.split == "eval" for s_ in samples)
    assert s["splits"]["train"]["tokens"] == sum(x.num_tokens for x in samples
                                                 if x.split == "train")
    assert s["splits"]["train"]["loss_tokens"] == sum(int(x.loss_mask.sum()) for x in samples
                                                      if x.split == "train")
    # The helper's commit records do not count image rows (as records older than the count).
    assert s["accounting"] == {"input_rows": 15, "written": 12, "image_rows": None,
                               "skipped": {"too_long": 3}, "failed": 0}
    assert s["layers"] == {"layer_ids": [1, 2], "dspark_feature_ids": [0, 1],
                           "features": "residual", "final_hidden": "post_norm"}
    assert s["unreferenced_bytes"] == 0
    # L=4: the default rule has one id ([1], held); the draft may use [0], [1] or [0, 1].
    assert s["feeds"] == {"target_layer_ids_subset_of": [0, 1], "default_feature_counts": [1],
                          "hidden_size": 16, "num_target_layers": 4, "vocab_size": 1024,
                          "final_hidden": "post_norm", "topk": spec.topk}

    assert main(["inspect", str(cache), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == tokens
    assert main(["inspect", str(cache)]) == 0
    table = capsys.readouterr().out
    assert f"tokens          {tokens:,}" in table
    assert "skipped too_long 3" in table
    assert "feeds drafts    target_layer_ids any subset of [0, 1] (default ids held for n = 1), " \
        "hidden_size 16, num_target_layers 4, vocab 1,024; final post_norm, " \
        + (f"top-{spec.topk} logprobs" if spec.topk else "no top-k") in table


def test_abandoned_attempt_counts_as_unreferenced(tmp_path: Path) -> None:
    """Slots written by an attempt that never committed are on disk but not in the ratio."""
    cache = build_cache(tmp_path / "c")
    before = summarize_cache(str(cache))
    orphan = cache / "aux_hidden.1/c/0/999999/0"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"\0" * 1000)
    after = summarize_cache(str(cache))
    assert after["unreferenced_bytes"] == 1000
    assert after["bytes_on_disk"] == before["bytes_on_disk"] + 1000
    assert after["compression_ratio"] == before["compression_ratio"]


def test_inspect_of_an_unfinalized_cache_exits_1(tmp_path: Path) -> None:
    """inspect refuses a store without a manifest (exit 1) and a missing path (exit 2)."""
    cache = build_cache(tmp_path / "c")
    (cache / "manifest.json").unlink()
    assert main(["inspect", str(cache)]) == 1
    assert main(["inspect", str(tmp_path / "nope")]) == 2


def _no_array_metadata(c: Path) -> None:
    (c / "final_hidden/zarr.json").unlink()


def _no_index(c: Path) -> None:
    (c / "index.parquet").unlink()


def _no_slot_table(c: Path) -> None:
    (c / "slots.parquet").unlink()


def _deep_manifest(c: Path) -> None:
    (c / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)


def _shard_links_out(c: Path) -> None:
    shard = next(p for p in sorted((c / "aux_hidden.0/c").rglob("*")) if p.is_file())
    shard.unlink()
    shard.symlink_to("/etc/passwd")


def _fifo_shard(c: Path) -> None:
    shard = next(p for p in sorted((c / "aux_hidden.0/c").rglob("*")) if p.is_file())
    shard.unlink()
    os.mkfifo(shard)


@pytest.mark.parametrize(("corrupt", "message"), [
    (_no_array_metadata, r"zarr metadata cannot be read .*final_hidden"),
    (_no_index, r"index.parquet is missing \(manifest storage.index_key\)"),
    (_no_slot_table, r"slots.parquet \(manifest storage.slot_table\) is missing"),
    (_deep_manifest, r"manifest.json: JSON nested deeper than 32 levels"),
    (_shard_links_out, r"aux_hidden.0/c/.*: a link to /etc/passwd, outside the cache root"),
    (_fifo_shard, r"aux_hidden.0/c/.*: a FIFO \(named pipe\), not a regular file"),
], ids=["array_metadata", "index", "slot_table", "deep_manifest", "shard_links_out",
        "fifo_shard"])
def test_damaged_cache_is_one_line_and_exit_1(tmp_path: Path, corrupt: object, message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """inspect on a cache missing array metadata or its index, or with a hostile manifest,
    prints one line naming it and exits 1 (a data problem, not a usage error)."""
    cache = build_cache(tmp_path / "c")
    corrupt(cache)  # type: ignore[operator]
    assert main(["inspect", str(cache)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert re.search(message, err[0]), err


def test_missing_shards_warn_that_the_ratio_is_inflated(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """With committed shard objects missing, inspect warns instead of showing a bare ratio."""
    cache = build_cache(tmp_path / "c")
    slot_object(cache, "aux_hidden.1", unit_slots(cache, 0)[0]).unlink()
    s = summarize_cache(str(cache))
    assert s["arrays"]["aux_hidden.1"]["missing_objects"] == 1
    assert s["warnings"] == [
        f"aux_hidden.1: 1 of {s['arrays']['aux_hidden.1']['objects']} committed slot objects are "
        "missing, so its ratio (and the total) is inflated; run `sparkforge validate`"]
    assert main(["inspect", str(cache)]) == 0
    assert "WARNING: aux_hidden.1: 1 of" in capsys.readouterr().out


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out
