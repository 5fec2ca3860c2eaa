"""Export of Gemma4 drafts: the config vLLM's Gemma4 loader reads, exact key set, refusals."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sparkforge.trainer.architectures import build_draft
from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.tiny import draft_tiny
from sparkforge.trainer.draft.draft_batch import FixedAnchors
from sparkforge.trainer.export import (
    ExportError,
    config_from_hf,
    export_draft,
    key_problems,
    load_draft,
)

ROPE = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}


def _cfg(**change: object) -> DraftConfig:
    gemma = {"architecture": "gemma4", "embedding_scale": 8.0, "final_logit_softcapping": 30.0,
             "head_dim": 32, "num_key_value_heads": 1, "rope_parameters": ROPE}
    return dataclasses.replace(draft_tiny(), **{**gemma, **change})


def _draft(cfg: DraftConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_draft(cfg)
    with torch.no_grad():  # bf16-representable weights make the bf16 export lossless
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model.eval()


def test_config_is_a_gemma4_text_config_of_full_k_eq_v_layers(tmp_path: Path) -> None:
    """transformers reads the exported config back as Gemma4 with the draft's per-layer sizes."""
    from transformers import AutoConfig

    cfg = _cfg(num_hidden_layers=2)
    out = export_draft(cfg, _draft(cfg).state_dict(), tmp_path / "d", engine="vllm")
    raw = json.loads((out / "config.json").read_text())
    expected = {"architectures": ["Gemma4DSparkModel"], "model_type": "gemma4_text",
                "attention_k_eq_v": True, "layer_types": ["full_attention"] * 2,
                "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
                "tie_word_embeddings": False, "hidden_size_per_layer_input": 0,
                "target_layer_ids": [0, 1, 2], "num_target_layers": 4, "mask_token_id": 3,
                "block_size": 4, "markov_rank": 16, "markov_head_type": "vanilla",
                "enable_confidence_head": True, "confidence_head_with_markov": True}
    assert {k: raw[k] for k in expected} == expected
    hf = AutoConfig.from_pretrained(out)
    for layer in range(2):
        assert hf.per_layer_config[layer].head_dim == 32
        assert hf.per_layer_config[layer].num_key_value_heads == 1
    assert hf.rope_parameters["full_attention"] == ROPE
    assert config_from_hf(raw) == dataclasses.replace(cfg, target_model_type="qwen3")


def test_export_reloads_with_identical_logits(tmp_path: Path) -> None:
    """Export -> reload gives a Gemma4 draft with bit-identical logits and confidences."""
    cfg = _cfg()
    model = _draft(cfg)
    out = export_draft(cfg, model.state_dict(), tmp_path / "d", engine="vllm")
    tensors = load_file(str(out / "model.safetensors"))
    assert not any("v_proj" in k or "v_norm" in k for k in tensors)
    reloaded = load_draft(out)
    assert type(reloaded) is type(model)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 256, (2, 24), generator=g),
             "loss_mask": torch.ones(2, 24),
             "target_hidden_states": torch.randn(2, 24, 3 * 64, generator=g),
             "target_last_hidden_states": torch.randn(2, 24, 64, generator=g)}
    anchors = torch.tensor([[6, 9, 15, 20], [7, 8, 12, 19]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    a = model(batch, FixedAnchors(anchors, keep))
    b = reloaded(batch, FixedAnchors(anchors, keep))
    assert torch.equal(a.draft_logits, b.draft_logits)
    assert torch.equal(a.target_logits, b.target_logits)
    assert torch.equal(a.confidence_logits, b.confidence_logits)


@pytest.mark.parametrize(("change", "engine", "reason"), [
    ({}, "sglang", "SGLang has no Gemma4 DSpark loader"),
    ({}, "any", "SGLang has no Gemma4 DSpark loader"),
    ({"embedding_scale": 1.0}, "vllm", r"sqrt\(hidden_size\)"),
    ({"markov_rank": 0, "confidence_head_with_markov": False}, "vllm", "rank-0"),
    ({"target_layer_ids": (-1, 1)}, "vllm", "-1 \\(the embeddings\\)"),
])
def test_unservable_gemma4_drafts_are_refused(tmp_path: Path, change: dict, engine: str,
                                              reason: str) -> None:
    """A Gemma4 draft vLLM would serve wrongly, or an engine without a loader, is refused."""
    cfg = _cfg(**change)
    with pytest.raises(ExportError, match=reason):
        export_draft(cfg, build_draft(cfg).state_dict(), tmp_path / "d",
                     engine=engine)  # type: ignore[arg-type]
    assert not (tmp_path / "d").exists()


def test_embeddings_are_required_because_the_loader_never_shares_the_targets(
        tmp_path: Path) -> None:
    """Without embed_tokens/lm_head vLLM's Gemma4 draft would run on uninitialised ones."""
    cfg = _cfg()
    with pytest.raises(ExportError, match="missing tensor embed_tokens.weight"):
        export_draft(cfg, build_draft(cfg).state_dict(), tmp_path / "d", engine="vllm",
                     include_embeddings=False)


def test_key_set_check_catches_a_v_proj_and_a_missing_feedforward_norm() -> None:
    """A Qwen3-style v_proj and a missing Gemma norm each fail the exact key-set check."""
    cfg = _cfg()
    good = build_draft(cfg).state_dict()
    assert key_problems(cfg, good) == []
    v_proj = {**good, "layers.0.self_attn.v_proj.weight": torch.zeros(32, 64)}
    assert key_problems(cfg, v_proj) == ["unexpected tensor layers.0.self_attn.v_proj.weight"]
    no_norm = {k: v for k, v in good.items() if "pre_feedforward" not in k}
    assert key_problems(cfg, no_norm) == [
        "missing tensor layers.0.pre_feedforward_layernorm.weight [64]"]
    assert math.isclose(cfg.embedding_scale, math.sqrt(cfg.hidden_size))
