"""Test helper: tiny random targets of every seed family, built offline with a real tokenizer.

Each family is its transformers 5.19 config type with small sizes (H=64, 4 layers, vocab 1024,
the tokenizer of ``sparkforge.app.tiny_target``); the extra settings per type are those that
make a tiny instance build and run (MLA needs as many KV heads as query heads, an indexer needs
its own head sizes). The types vLLM's CPU build runs or nearly runs (the Qwen3 family, MiniMax-M3)
get head_dim 32, the smallest its CPU attention takes (at 16 MiniMax stops there, before its
real CPU blocker). MiniMax-M3 VL's settings and builder live in ``sparkforge.app.tiny_minimax_vl``
(``python -m sparkforge.app.tiny_target --model_type minimax_m3_vl`` builds it with images).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sparkforge.app.tiny_minimax_vl import (
    build_tiny_minimax_vl,
    minimax_text_settings,
    pinned_config,
)

_MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "qk_head_dim": 24, "num_key_value_heads": 4, "head_dim": 8}
_INDEXER = {"index_n_heads": 2, "index_head_dim": 16}
_GATED_DELTANET = {"hidden_size": 128, "head_dim": 32, "num_key_value_heads": 2,
                   "layer_types": ["linear_attention", "full_attention"] * 2,
                   "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "linear_key_head_dim": 64, "linear_value_head_dim": 64}

FAMILY_SETTINGS: dict[str, dict[str, Any]] = {
    "qwen3": {"hidden_size": 128, "head_dim": 32, "num_key_value_heads": 2},
    "qwen3_moe": {"hidden_size": 128, "head_dim": 32, "num_key_value_heads": 2,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen3_next": {**_GATED_DELTANET, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                   "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen3_5_text": _GATED_DELTANET,
    "glm_moe_dsa": {**_MLA, **_INDEXER, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "index_topk": 8,
                    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
                    "layer_types": ["indexed_attention"] * 4},
    "minimax_m3_vl_text": minimax_text_settings(),
    "kimi_linear": {**_MLA, "q_lora_rank": None, "num_experts": 4, "num_experts_per_token": 2,
                    "moe_intermediate_size": 32, "num_shared_experts": 1,
                    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
                    "layer_types": ["linear_attention", "full_attention"] * 2,
                    "linear_head_dim": 16, "linear_num_heads": 4},
    "gemma4_text": {"layer_types": ["sliding_attention", "full_attention"] * 2,
                    "sliding_window": 16, "hidden_size_per_layer_input": 0,
                    "vocab_size_per_layer_input": 1024, "global_head_dim": 32,
                    "num_global_key_value_heads": 1},
}
"""Config overrides per model type on top of :data:`BASE`."""

BASE: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 1024, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
    "max_position_embeddings": 4096, "initializer_range": 0.08, "tie_word_embeddings": False,
    "pad_token_id": 0, "bos_token_id": None, "eos_token_id": 2,
}
COMPOSITES = {"minimax_m3_vl": "minimax_m3_vl_text"}
"""Multimodal top-level types and the text type nested as their ``text_config``."""
MODEL_TYPES: tuple[str, ...] = (*FAMILY_SETTINGS, *COMPOSITES, "deepseek_v4", "gemma4")
"""Every model type the ``tiny_family`` fixture builds (the last two by the app's builders)."""


def tiny_settings(model_type: str) -> dict[str, Any]:
    """The config settings of a tiny text model type (:data:`BASE` with its overrides)."""
    return {**BASE, **FAMILY_SETTINGS[model_type]}


def text_config(model_type: str) -> Any:
    """The tiny transformers config of a text model type (settings re-applied after init)."""
    return pinned_config(model_type, tiny_settings(model_type))


def build_tiny_family(out_dir: Path, model_type: str, *, seed: int = 0) -> Path:
    """Write a tiny random ``model_type`` target (fp32, eager attention) + tokenizer to ``out_dir``.

    ``model_type`` is a key of :data:`FAMILY_SETTINGS` or of :data:`COMPOSITES` (then the
    multimodal top level around the tiny text model, built with a one-layer vision tower by
    ``sparkforge.app.tiny_minimax_vl``, without image tokens: the text-only case).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from sparkforge.app.tiny_text import build_tokenizer

    if model_type in COMPOSITES:
        return build_tiny_minimax_vl(out_dir, seed=seed, images=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir, vocab_size=BASE["vocab_size"])
    torch.manual_seed(seed)
    config = text_config(model_type)
    config._attn_implementation = "eager"
    AutoModelForCausalLM.from_config(config).float().save_pretrained(str(out_dir))
    return out_dir
