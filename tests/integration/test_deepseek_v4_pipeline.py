"""A tiny DeepSeek-V4 target goes produce -> validate -> train -> export -> eval via the CLI.

vLLM 0.32 (CPU) cannot parse a transformers-5.19 ``deepseek_v4`` config (its own config class
allows only ``mlp_layer_types`` in ('sparse', 'dense'), transformers writes 'moe'), so the cache
is captured by the HF backend, and the exported Qwen3-shaped draft is loaded through vLLM's
``Qwen3DSparkForCausalLM`` against a Qwen3 stand-in target of the same hidden and vocab sizes.
The deepseek_v4 draft trains and evaluates from its checkpoint; its export is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from export_helpers import eval_report, load_in_vllm

from sparkforge.app.cli import main

DRAFT = {"mask_token_id": 3, "hidden_size": 64, "vocab_size": 1024, "num_target_layers": 4,
         "target_layer_ids": [0, 1, 2], "num_hidden_layers": 1, "block_size": 4,
         "num_anchors": 8, "markov_rank": 16, "target_model_type": "deepseek_v4"}


def _train_config(out: Path, cache: Path, name: str, **draft: object) -> Path:
    config = {"seed_everything": 0, "model": {"draft": {**DRAFT, **draft},
                                              "attn_implementation": "sdpa"},
              "data": {"uri": str(cache), "max_seq_len": 512, "batch_size": 4,
                       "num_workers": 0},
              "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 3,
                          "default_root_dir": str(out / "train"), "logger": False,
                          "enable_progress_bar": False}}
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_v4_target_runs_every_stage(tmp_path: Path, tiny_v4_target: Path,
                                    tiny_v4_cache: Path) -> None:
    """HF capture of a V4 target feeds a Qwen3-shaped draft that trains, exports and evaluates."""
    from sparkforge.app.tiny_target import build_tiny_target

    cache = tiny_v4_cache
    capture = json.loads((cache / "manifest.json").read_text())["capture"]
    assert (capture["features"], capture["final_hidden"]) == ("hc_mean", "lm_head_input")

    train = _train_config(tmp_path, cache, "train")
    assert main(["validate", str(cache), "--deep", "--against", str(train)]) == 0
    residual = _train_config(tmp_path, cache, "residual", target_features="residual")
    assert main(["validate", str(cache), "--against", str(residual)]) == 1

    assert main(["train", "--config", str(train)]) == 0
    ckpt = next((tmp_path / "train").rglob("*.ckpt"))
    draft = tmp_path / "draft"
    assert main(["export", str(ckpt), str(draft), "--engine", "vllm"]) == 0
    config = json.loads((draft / "config.json").read_text())
    assert config["model_type"] == "qwen3"   # vLLM turns deepseek types into MTP drafters
    assert config["architectures"] == ["Qwen3DSparkModel"]

    stand_in = build_tiny_target(tmp_path / "qwen3_stand_in", hidden_size=64, head_dim=32)
    res = load_in_vllm(stand_in, draft)
    assert res["aux_layer_ids"] == [1, 2, 3]
    assert res["params_not_equal"] == []
    assert res["tensors_not_loaded"] == []

    report = eval_report(draft, tiny_v4_target, cache, tmp_path / "eval")
    assert report["speculative"]["tau"] >= 1.0
    assert report["teacher_forced"]["metrics"]["tau"] >= 1.0


@pytest.mark.slow
def test_v4_drafter_trains_and_evaluates(tmp_path: Path, tiny_v4_target: Path,
                                         tiny_v4_cache: Path) -> None:
    """architecture deepseek_v4 trains on the V4 cache with the last layer's feature (ids
    [1, 2, 3] of 4 layers, as V4-Flash's [40, 41, 42] of 43) and evaluates; export says why not."""
    train = _train_config(tmp_path, tiny_v4_cache, "train", architecture="deepseek_v4",
                          target_layer_ids=[1, 2, 3])
    capture = json.loads((tiny_v4_cache / "manifest.json").read_text())["capture"]
    assert capture["layer_ids"] == [1, 2, 3, 4]   # HF index 4 = L: the last layer's raw output
    assert main(["validate", str(tiny_v4_cache), "--deep", "--against", str(train)]) == 0
    assert main(["train", "--config", str(train)]) == 0
    ckpt = next((tmp_path / "train").rglob("*.ckpt"))
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["draft_config"]["architecture"] == "deepseek_v4"
    assert state["draft_config"]["options"]["q_lora_rank"] == 32
    assert "model.layers.0.attn.attn_sink" in state["state_dict"]

    assert main(["export", str(ckpt), str(tmp_path / "draft"), "--engine", "vllm"]) == 1
    assert not (tmp_path / "draft").exists()

    report = eval_report(ckpt, tiny_v4_target, tiny_v4_cache, tmp_path / "eval")
    assert report["speculative"]["tau"] >= 1.0
    assert report["teacher_forced"]["metrics"]["tau"] >= 1.0
