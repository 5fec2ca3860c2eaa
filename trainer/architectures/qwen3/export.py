"""The Qwen3-shaped serving format: the draft layout every engine loads (vLLM, SGLang).

A Qwen3-shaped ``config.json`` built with ``transformers.Qwen3Config`` plus the DSpark fields, and
bare tensor keys (11 per draft layer + the shared ones). Drafts of any target family can use it:
the draft's backbone does not depend on the target's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.serving import head_problems, id_problems
from sparkforge.trainer.draft.config import DSPARK_KEYS, dspark_fields, layout_shapes

if TYPE_CHECKING:
    from sparkforge.trainer.architectures import Engine


def serving_problems(cfg: DraftConfig, engine: Engine) -> list[str]:
    """Reasons ``engine`` could not serve this draft correctly (empty when it can)."""
    return backbone_problems(cfg, engine) + head_problems(cfg, engine)


def backbone_problems(cfg: DraftConfig, engine: Engine) -> list[str]:
    """What ``engine`` cannot serve in any Qwen3-shaped format (DSpark or DFlash) for this draft."""
    problems = id_problems(cfg, engine)
    if cfg.embedding_scale != 1.0 or cfg.final_logit_softcapping:
        problems.append("the draft uses a Gemma-style embedding scale or logit softcap, which the "
                        "Qwen3-shaped serving format cannot express (use architecture 'gemma4')")
    return problems


def hf_config(cfg: DraftConfig) -> dict[str, Any]:
    """``config.json`` contents: a Qwen3Config with the DSpark fields."""
    from transformers import Qwen3Config

    fields = serving_config(cfg)
    fields["max_window_layers"] = cfg.num_hidden_layers
    out: dict[str, Any] = Qwen3Config(**fields, dtype="bfloat16").to_dict()
    assert out["model_type"] == "qwen3", out["model_type"]
    assert out["architectures"] == ["Qwen3DSparkModel"], out["architectures"]
    return out


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every required tensor and its shape for this config (11 per draft layer + 7 shared)."""
    h, hd, i_sz = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.num_features * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq, h), p + "self_attn.k_proj.weight": (nkv, h),
            p + "self_attn.v_proj.weight": (nkv, h), p + "self_attn.o_proj.weight": (h, nq),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (i_sz, h), p + "mlp.up_proj.weight": (i_sz, h),
            p + "mlp.down_proj.weight": (h, i_sz),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (nq,), p + "self_attn.k_proj.bias": (nkv,),
                       p + "self_attn.v_proj.bias": (nkv,)}
    return shapes | layout_shapes(cfg)


def draft_config_from_hf(config: Mapping[str, Any]) -> DraftConfig:
    """Read a DSpark ``config.json`` (ours, DeepSpec's or NeMo's Qwen3-shaped drafts)."""
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "rms_norm_eps", "rope_parameters",
            "max_position_embeddings", "attention_bias", "num_hidden_layers",
            "initializer_range", *DSPARK_KEYS)
    fields = {k: config[k] for k in keys if config.get(k) is not None}
    return DraftConfig(**fields)


def backbone_config(cfg: DraftConfig) -> dict[str, Any]:
    """The Qwen3 backbone fields of a served draft's config.json (DSpark and DFlash alike).

    Every layer is ``full_attention``: engines run a ``sliding_attention`` draft layer causally.
    """
    layers = cfg.num_hidden_layers
    return {
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "num_hidden_layers": layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_parameters": dict(cfg.rope_parameters),
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias, "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False, "layer_types": ["full_attention"] * layers,
        "block_size": cfg.block_size, "num_target_layers": cfg.num_target_layers,
    }


def serving_config(cfg: DraftConfig) -> dict[str, Any]:
    """config.json fields vLLM/SGLang read for a Qwen3-shaped DSpark draft."""
    return {**backbone_config(cfg), "architectures": ["Qwen3DSparkModel"], **dspark_fields(cfg)}
