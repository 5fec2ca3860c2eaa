"""A tiny Gemma4 target goes produce -> validate -> train -> export -> vLLM load -> eval.

The cache is captured by the HF backend; the draft is the Gemma4-shaped one (``architecture:
gemma4``), exported in the format vLLM's ``Gemma4DSparkForCausalLM`` loads, which is then
instantiated on CPU from the exported directory and compared parameter by parameter with the
exported tensors (that loader ignores unknown keys and never reports missing ones).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from export_helpers import eval_report, load_in_vllm

from sparkforge.app.cli import main

PRODUCER = {"backend": "hf", "layer_ids": [0, 1, 2], "hidden_dtype": "float32",
            "rows_per_unit": 8, "shard_rows": 1024, "max_seq_len": 512, "eval_fraction": 0.25,
            "overlong": "truncate", "parity_samples": 0}
DRAFT = {"mask_token_id": 3, "hidden_size": 64, "vocab_size": 1024, "num_target_layers": 4,
         "target_layer_ids": [0, 1, 2], "num_hidden_layers": 2, "block_size": 4,
         "num_anchors": 8, "markov_rank": 16, "target_model_type": "gemma4_text",
         "architecture": "gemma4"}


@pytest.mark.slow
def test_gemma4_target_trains_a_gemma4_draft_that_vllm_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """HF capture of a Gemma4 target trains the Gemma4 draft; vLLM loads every tensor; eval runs."""
    from sparkforge.app.tiny_target import build_tiny_gemma4
    from sparkforge.app.tiny_text import demo_conversations

    target = build_tiny_gemma4(tmp_path / "target")
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in demo_conversations(16)))
    cache = tmp_path / "cache"
    producer = tmp_path / "producer.yaml"
    producer.write_text(yaml.safe_dump({**PRODUCER, "data": str(rows), "output": str(cache),
                                        "engine": {"model": str(target), "dtype": "float32"}}))
    assert main(["produce", "--config", str(producer)]) == 0

    train = tmp_path / "train.yaml"
    train.write_text(yaml.safe_dump({
        "seed_everything": 0, "model": {"draft": DRAFT, "attn_implementation": "sdpa"},
        "data": {"uri": str(cache), "max_seq_len": 512, "batch_size": 4, "num_workers": 0},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 3, "logger": False,
                    "default_root_dir": str(tmp_path / "train"), "enable_progress_bar": False}}))
    assert main(["validate", str(cache), "--deep", "--against", str(train)]) == 0
    assert main(["train", "--config", str(train)]) == 0
    ckpt = next((tmp_path / "train").rglob("*.ckpt"))
    draft = tmp_path / "draft"
    assert main(["export", str(ckpt), str(draft), "--engine", "any"]) == 1
    assert "SGLang has no Gemma4 DSpark loader" in capsys.readouterr().err
    assert main(["export", str(ckpt), str(draft), "--engine", "vllm"]) == 0
    config = json.loads((draft / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("gemma4_text",
                                                               ["Gemma4DSparkModel"])
    assert (config["head_dim"], config["num_key_value_heads"]) == (64, 1)   # full-attention's
    assert config["final_logit_softcapping"] == 30.0

    res = load_in_vllm(target, draft)
    assert res["model_class"] == "Gemma4DSparkForCausalLM"
    assert res["aux_layer_ids"] == [1, 2, 3]
    assert res["num_params"] == 11 * 2 + 9
    assert res["params_without_tensor"] == []
    assert res["params_not_equal"] == []
    assert res["tensors_not_loaded"] == []
    assert res["confidence_head"] is True
    # vLLM 0.32 passes the Markov bias through the softcapped logits processor.
    assert res["markov_bias_vs_softcapped"] < 1e-3

    report = eval_report(draft, target, cache, tmp_path / "eval")
    assert report["speculative"]["tau"] >= 1.0
    assert report["teacher_forced"]["metrics"]["tau"] >= 1.0
