"""``sparkforge produce`` over a weighted mix of a JSONL file and a Hugging Face dataset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from producer_helpers import cache_samples, chat_rows, write_jsonl

from sparkforge.app.cli import main
from sparkforge.manifests.open import open_cache

datasets = pytest.importorskip("datasets")


def _sharegpt_dataset(folder: Path) -> Path:
    """5 ShareGPT rows, the last with an unknown speaker (counted as unknown_role)."""
    conversations = [[{"from": "human", "value": r["messages"][0]["content"]},
                      {"from": "gpt", "value": r["messages"][1]["content"]}]
                     for r in chat_rows(4, seed=3)]
    conversations.append([{"from": "robot", "value": "beep"}, {"from": "gpt", "value": "x"}])
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"conversations": conversations})}).save_to_disk(str(folder))
    return folder


@pytest.mark.slow
def test_mix_is_drawn_recorded_and_accounted(tiny_target: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """12 rows, 3:1 between 4 chat rows (each drawn 9 / 4 = twice, one row thrice) and the 5-row
    ShareGPT dataset (3 rows subsampled); the manifest, the summary and inspect agree with the
    samples in the cache."""
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    hf = _sharegpt_dataset(tmp_path / "sharegpt")
    cfg = {"mix": [{"data": str(chat), "weight": 3.0, "name": "chat"},
                   {"data": f"{hf}:train", "weight": 1.0, "name": "sharegpt"}],
           "mix_rows": 12, "mix_seed": 1, "output": str(tmp_path / "cache"), "backend": "hf",
           "layer_ids": [0, 1, 2], "hidden_dtype": "float32", "rows_per_unit": 4,
           "shard_rows": 256, "progress": False,
           "engine": {"model": str(tiny_target), "max_model_len": 128, "dtype": "float32"}}
    config = tmp_path / "produce.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert main(["produce", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "mix: chat" in out
    assert "9 rows drawn of 4 held" in out

    reader = open_cache(cfg["output"])
    m = reader.manifest
    assert m.data.mix is not None
    assert m.data.mix_seed == 1
    chat_mix, hf_mix = m.data.mix
    assert (chat_mix.rows, chat_mix.source_rows, chat_mix.first_sample) == (9, 4, 0)
    assert (hf_mix.rows, hf_mix.source_rows, hf_mix.first_sample) == (3, 5, 9)
    identity = m.data.sources[hf_mix.first_source].hf_dataset
    assert identity is not None
    assert identity.split == "train"
    assert identity.revision is None
    assert identity.fingerprint == datasets.load_from_disk(str(hf))["train"]._fingerprint
    samples = cache_samples(cfg["output"])
    # The 9 chat draws hold the 4 chat rows, so their token ids repeat.
    chat_ids = {tuple(samples[i]["input_ids"].tolist()) for i in range(9) if i in samples}
    assert len(chat_ids) == 4
    hf_written = sum(1 for i in samples if i >= 9)
    skipped = m.accounting.skipped.get("unknown_role", 0)
    assert hf_written + skipped == 3
    assert m.accounting.written == len(samples)

    assert main(["validate", "--deep", cfg["output"]]) == 0
    capsys.readouterr()
    assert main(["inspect", cfg["output"], "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    by_name = {e["name"]: e for e in summary["mix"]}
    assert by_name["chat"]["written"] == sum(1 for i in samples if i < 9) == 9
    assert by_name["sharegpt"]["written"] == hf_written
    assert by_name["sharegpt"]["skipped_or_failed"] == skipped
    assert summary["datasets"][0]["fingerprint"] == identity.fingerprint
    assert main(["inspect", cfg["output"]]) == 0
    assert "sharegpt" in capsys.readouterr().out


def test_data_and_mix_are_exclusive(tiny_target: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Both, or neither: one usage error naming the two flags."""
    base = ["produce", "--output", str(tmp_path / "c"), "--engine.model", str(tiny_target)]
    assert main([*base, "--data", "a.jsonl", "--mix",
                 '[{"data": "b.jsonl", "weight": 1}]']) == 2
    assert "exactly one of --data and --mix" in capsys.readouterr().err
    assert main(base) == 2
    assert "exactly one of --data and --mix" in capsys.readouterr().err
