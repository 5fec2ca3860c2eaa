"""A tiny multimodal Gemma4 goes produce -> validate -> train -> export -> eval on image chats.

``python -m sparkforge.app.tiny_target OUT --model_type gemma4 --rows N`` builds the target (a
one-layer vision tower, its PIL image processor) and chat rows half of which carry generated
images. The HF backend captures text and image rows into one cache (parity covers image rows);
rows with bad images are counted by reason; the Gemma4 draft trains on the mixed cache, and eval
decodes image prompts with their pixel values, reporting image and text prompts apart. The tiny
MiniMax-M3 VL (``--model_type minimax_m3_vl``) is captured the same way, with parity on its image
rows.
"""

from __future__ import annotations

import json
import re
from importlib.resources import files
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from sparkforge.app.cli import main
from sparkforge.app.tiny_target import main as tiny_target_main

pytestmark = pytest.mark.slow  # ~1 min on 2 cores

BAD = {"image_missing": {"type": "image", "path": "images/nonexistent.png"},
       "image_path_refused": {"type": "image", "path": "/etc/hostname"},
       "image_source_refused": {"type": "image", "url": "http://169.254.169.254/latest/"},
       "image_unreadable": {"type": "image_url", "image_url": {"url": "data:image/png;base64,%"}},
       "image_undecodable": {"type": "image_url", "image_url": {
           "url": "data:image/png;base64,bm90IGFuIGltYWdl"}}}


def _bad_row(part: dict) -> dict:
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]},
                         {"role": "assistant", "content": "A square."}]}


def test_a_mixed_text_and_image_cache_trains_and_evaluates(tmp_path: Path) -> None:
    """Image rows are captured with their pixels, bad ones counted, and the cache trains a draft
    whose eval reports image and text prompts apart."""
    target = tmp_path / "target"
    assert tiny_target_main([str(target), "--model_type", "gemma4", "--rows", "16"]) == 0
    rows = [json.loads(line) for line in (target / "chat.jsonl").read_text().splitlines()]
    assert sum(isinstance(r["messages"][1]["content"], list) for r in rows) == 8
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in
                            [*rows, *(_bad_row(p) for p in BAD.values())]))
    cache = tmp_path / "cache"
    producer = tmp_path / "producer.yaml"
    producer.write_text(yaml.safe_dump({
        "backend": "hf", "data": str(data), "output": str(cache), "layer_ids": [0, 1, 2],
        "hidden_dtype": "float32", "rows_per_unit": 8, "shard_rows": 1024, "max_seq_len": 512,
        "eval_fraction": 0.25, "parity_samples": 4,
        "engine": {"model": str(target), "dtype": "float32"}}))
    assert main(["produce", "--config", str(producer)]) == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["accounting"]["written"] == 16
    assert manifest["accounting"]["skipped"] == {reason: 1 for reason in BAD}
    assert manifest["parity"]["passed"]
    assert manifest["parity"]["num_image_samples"] == 2
    images = manifest["producer_config"]["resolved"]["images"]
    assert images["processor"] == "Gemma4ImageProcessorPil"

    train = tmp_path / "train.yaml"   # the packaged example, with this run's cache and steps
    example = yaml.safe_load((files("sparkforge.trainer") / "examples" / "tiny_vl.yaml")
                             .read_text())
    example["data"]["uri"] = str(cache)
    example["trainer"].update(max_steps=3, logger=False, default_root_dir=str(tmp_path / "train"))
    train.write_text(yaml.safe_dump(example))
    assert main(["validate", str(cache), "--deep", "--against", str(train)]) == 0
    assert main(["train", "--config", str(train)]) == 0
    draft = tmp_path / "draft"
    assert main(["export", str(next((tmp_path / "train").rglob("*.ckpt"))), str(draft),
                 "--engine", "vllm"]) == 0
    out = tmp_path / "eval"
    assert main(["eval", "--draft", str(draft), "--target", str(target), "--cache", str(cache),
                 "--prompts", str(data), "--out_dir", str(out), "--num_prompts", "6",
                 "--max_new_tokens", "6"]) == 0
    report = json.loads((out / "eval_report.json").read_text())
    kinds = report["speculative"]["by_prompt_kind"]
    assert (kinds["image"]["prompts"], kinds["text"]["prompts"]) == (3, 3)
    assert min(kinds["image"]["tau"], kinds["text"]["tau"]) >= 1.0
    assert report["speculative"]["rounds"] == kinds["image"]["rounds"] + kinds["text"]["rounds"]
    assert report["teacher_forced"]["metrics"]["tau"] >= 1.0


def test_minimax_m3_vl_image_rows_are_captured_and_pass_parity(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny MiniMax-M3 VL from tiny_target: its image rows are captured with their pixels
    (the manifest, the produce summary and inspect count them), every image span is
    unsupervised, and parity forwards image rows with their pixel values on both sides and
    passes."""
    from transformers import AutoTokenizer

    from sparkforge.app.tiny_minimax_vl import MINIMAX_IMAGE_TOKENS
    from sparkforge.manifests.open import open_cache
    from sparkforge.manifests.summary import summarize_cache

    target = tmp_path / "target"
    assert tiny_target_main([str(target), "--model_type", "minimax_m3_vl", "--rows", "8"]) == 0
    rows = [json.loads(line) for line in (target / "chat.jsonl").read_text().splitlines()]
    with_images = {i for i, r in enumerate(rows) if isinstance(r["messages"][1]["content"], list)}
    assert len(with_images) == 4
    cache = tmp_path / "cache"
    producer = tmp_path / "producer.yaml"
    producer.write_text(yaml.safe_dump({
        "backend": "hf", "data": str(target / "chat.jsonl"), "output": str(cache),
        "layer_ids": [0, 1, 2], "hidden_dtype": "float32", "rows_per_unit": 8,
        "shard_rows": 1024, "max_seq_len": 512, "parity_samples": 4,
        "engine": {"model": str(target), "dtype": "float32"}}))
    capsys.readouterr()
    assert main(["produce", "--config", str(producer)]) == 0
    assert re.search(r"^written +8 \(4 image rows\)$", capsys.readouterr().out, re.M)
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["target"]["model_type"] == "minimax_m3_vl_text"
    assert manifest["accounting"]["written"] == 8
    assert manifest["accounting"]["image_rows"] == 4
    assert manifest["producer_config"]["resolved"]["images"]["processor"] == \
        "MiniMaxM3VLImageProcessor"
    assert manifest["parity"]["passed"], manifest["parity"]
    assert manifest["parity"]["num_image_samples"] == 2
    assert summarize_cache(str(cache))["accounting"]["image_rows"] == 4
    assert main(["inspect", str(cache)]) == 0
    assert "8 written (4 image rows)" in capsys.readouterr().out
    boi, eoi, image = AutoTokenizer.from_pretrained(target).convert_tokens_to_ids(
        list(MINIMAX_IMAGE_TOKENS))
    reader = open_cache(str(cache))
    for i in range(8):
        sample = reader.read_sample(i)
        ids, mask = sample.input_ids, sample.loss_mask
        starts, ends = np.flatnonzero(ids == boi), np.flatnonzero(ids == eoi)
        assert (len(starts) > 0) is (i in with_images), i
        assert len(starts) == len(ends)
        for start, end in zip(starts, ends, strict=True):
            assert end - start > 1, i
            assert (ids[start + 1:end] == image).all(), i
            assert not mask[start:end + 1].any(), i
        assert mask.any(), i


def test_parquet_image_rows_capture_like_jsonl(tmp_path: Path) -> None:
    """The same chats as Parquet (every content a list of parts) give the same cached samples."""
    target = tmp_path / "target"
    assert tiny_target_main([str(target), "--model_type", "gemma4", "--rows", "6"]) == 0
    rows = [json.loads(line) for line in (target / "chat.jsonl").read_text().splitlines()]
    for row in rows:
        for m in row["messages"]:
            if isinstance(m["content"], str):
                m["content"] = [{"type": "text", "text": m["content"]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    from sparkforge.manifests.open import open_cache

    samples = {}
    for name, data in (("jsonl", target / "chat.jsonl"), ("parquet", tmp_path / "chat.parquet")):
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump({
            "backend": "hf", "data": str(data), "output": str(tmp_path / name),
            "layer_ids": [0, 1, 2], "hidden_dtype": "float32", "rows_per_unit": 8,
            "shard_rows": 1024, "max_seq_len": 512,
            "engine": {"model": str(target), "dtype": "float32"}}))
        assert main(["produce", "--config", str(config)]) == 0
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["accounting"]["written"] == 6
        reader = open_cache(str(tmp_path / name))
        samples[name] = [reader.read_sample(i) for i in range(6)]
    for a, b in zip(samples["jsonl"], samples["parquet"], strict=True):
        assert a.input_ids.tolist() == b.input_ids.tolist()
        assert a.loss_mask.tolist() == b.loss_mask.tolist()
        assert (a.aux_hidden == b.aux_hidden).all()
