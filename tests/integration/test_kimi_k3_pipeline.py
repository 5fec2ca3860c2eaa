"""Kimi-K3 and Qwen3-MoE targets go produce -> validate -> train -> export -> vLLM load -> eval.

The targets are a tiny ``kimi_linear`` (K3's text model; the HF backend captures it, the vLLM CPU
build does not start it) and a tiny ``qwen3_moe``, both captured by the HF backend. From the Kimi
cache, the MLA DSpark draft (``architecture: kimi_k3``) in the format vLLM's
``K3DSparkForCausalLM`` loads; from each cache, the DFlash recipe's draft (whose recipes name
these targets besides dense Qwen3) in the format ``DFlashQwen3ForCausalLM`` loads. Each is
built by vLLM on CPU from the exported directory and compared parameter by parameter with the
exported tensors (the loaders ignore unknown keys and never report missing ones), then evaluated.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from export_helpers import eval_report, load_in_vllm

from sparkforge.app.cli import main

PRODUCER = {"backend": "hf", "layer_ids": [0, 1, 2], "hidden_dtype": "float32",
            "rows_per_unit": 8, "shard_rows": 1024, "max_seq_len": 512, "eval_fraction": 0.25,
            "overlong": "truncate", "parity_samples": 0}
TARGET_FACING = {"mask_token_id": 3, "hidden_size": 64, "vocab_size": 1024,
                 "num_target_layers": 4, "target_layer_ids": [0, 1, 2], "block_size": 4,
                 "num_anchors": 8, "target_model_type": "kimi_linear"}
HIDDEN_SIZE = {"kimi_linear": 64, "qwen3_moe": 128}  # of the tiny_families targets
# Kimi-Linear has no query bottleneck; vLLM's K3 draft needs one, so the run sets its width.
K3_DRAFT = {**TARGET_FACING, "num_hidden_layers": 2, "markov_rank": 16,
            "architecture": "kimi_k3", "options": {"q_lora_rank": 32}}


@pytest.fixture(scope="module")
def captured(tiny_family: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
             ) -> Callable[[str], tuple[Path, Path]]:
    """``captured(model_type)``: a tiny target and its HF-captured cache (16 chat rows, feature
    ids [0, 1, 2]), built once per module."""
    from sparkforge.app.tiny_text import demo_conversations

    built: dict[str, tuple[Path, Path]] = {}

    def build(model_type: str) -> tuple[Path, Path]:
        if model_type not in built:
            target, out = tiny_family(model_type), tmp_path_factory.mktemp(f"{model_type}_cache")
            rows = out / "chat.jsonl"
            rows.write_text("".join(json.dumps(r) + "\n" for r in demo_conversations(16)))
            producer = out / "producer.yaml"
            producer.write_text(yaml.safe_dump({
                **PRODUCER, "data": str(rows), "output": str(out / "c"),
                "engine": {"model": str(target), "dtype": "float32"}}))
            assert main(["produce", "--config", str(producer)]) == 0
            built[model_type] = target, out / "c"
        return built[model_type]

    return build


@pytest.fixture(scope="module")
def kimi(captured: Callable[[str], tuple[Path, Path]]) -> tuple[Path, Path]:
    """The tiny Kimi target and its cache."""
    return captured("kimi_linear")


def _train(out: Path, cache: Path, model: dict[str, Any]) -> Path:
    """Validate the cache against the run, train 3 steps; the checkpoint."""
    train = out / "train.yaml"
    train.write_text(yaml.safe_dump({
        "seed_everything": 0, "model": {**model, "attn_implementation": "sdpa"},
        "data": {"uri": str(cache), "max_seq_len": 512, "batch_size": 4, "num_workers": 0},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 3, "logger": False,
                    "default_root_dir": str(out / "train"), "enable_progress_bar": False}}))
    assert main(["validate", str(cache), "--deep", "--against", str(train)]) == 0
    assert main(["train", "--config", str(train)]) == 0
    return next((out / "train").rglob("*.ckpt"))


@pytest.mark.slow
def test_kimi_target_trains_a_k3_draft_that_vllm_loads(
        kimi: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """HF capture of a Kimi target trains the MLA draft; vLLM's K3 class loads every tensor."""
    target, cache = kimi
    ckpt = _train(tmp_path, cache, {"draft": K3_DRAFT})
    draft = tmp_path / "draft"
    assert main(["export", str(ckpt), str(draft), "--engine", "any"]) == 1
    assert "SGLang has no Kimi-K3 DSpark loader" in capsys.readouterr().err
    assert main(["export", str(ckpt), str(draft), "--engine", "vllm"]) == 0
    config = json.loads((draft / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("k3_dspark", ["K3DSparkModel"])
    # vLLM's K3 config counts the features here; the target's depth is kept beside it.
    assert (config["num_target_layers"], config["target_num_hidden_layers"]) == (3, 4)
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]) == (
        32, 16, 8)

    res = load_in_vllm(target, draft)
    assert res["model_class"] == "K3DSparkForCausalLM"
    assert res["aux_layer_ids"] == [1, 2, 3]
    # 10 per layer (q_a/kv_a and gate/up fused), context_proj/norm, the cross-layer
    # context_kv_proj, final_norm, the Markov and confidence heads.
    assert res["num_params"] == 10 * 2 + 8
    assert res["params_without_tensor"] == []
    assert res["params_not_equal"] == []
    # vLLM shares the target's embedding and head and drops the draft's copies.
    assert res["tensors_not_loaded"] == ["embed_tokens.weight", "lm_head.weight"]
    assert res["confidence_head"] is True
    assert res["markov_bias_vs_plain"] < 1e-3

    report = eval_report(draft, target, cache, tmp_path / "eval")
    assert report["speculative"]["tau"] >= 1.0
    assert report["teacher_forced"]["metrics"]["tau"] >= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["kimi_linear", "qwen3_moe"])
def test_family_cache_trains_a_dflash_draft_that_vllm_loads(
        model_type: str, captured: Callable[[str], tuple[Path, Path]], tmp_path: Path) -> None:
    """The DFlash recipe trains from a Kimi or Qwen3-MoE cache; vLLM's DFlash class loads every
    tensor."""
    target, cache = captured(model_type)
    facing = {**TARGET_FACING, "hidden_size": HIDDEN_SIZE[model_type],
              "target_model_type": model_type}
    ckpt = _train(tmp_path, cache, {"recipe": "dflash",
                                    "draft": {**facing, "num_hidden_layers": 1}})
    draft = tmp_path / "draft"
    assert main(["export", str(ckpt), str(draft), "--engine", "vllm"]) == 0
    config = json.loads((draft / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3", ["DFlashDraftModel"])

    res = load_in_vllm(target, draft, method="dflash")
    assert (res["method"], res["model_class"]) == ("dflash", "DFlashQwen3ForCausalLM")
    assert res["aux_layer_ids"] == [1, 2, 3]
    assert (res["num_speculative_tokens"], res["mask_token_id"]) == (3, 3)
    assert res["params_without_tensor"] == ["model.mask_embedding"]   # vLLM drops it by design
    assert res["params_not_equal"] == []
    assert res["tensors_not_loaded"] == []

    report = eval_report(draft, target, cache, tmp_path / "eval")
    assert report["speculative"]["tau"] >= 1.0
    assert len(report["speculative"]["acceptance_by_position"]) == 3
