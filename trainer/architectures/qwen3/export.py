"""The Qwen3-shaped serving format: the draft layout every engine loads (vLLM, SGLang).

A Qwen3-shaped ``config.json`` built with ``transformers.Qwen3Config`` plus the DSpark fields, and
bare tensor keys (11 per draft layer + the shared ones). Drafts of any target family can use it:
the draft's backbone does not depend on the target's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sparkforge.shared.layer_ids import every_engine_feature_range
from sparkforge.trainer.draft.config import DSPARK_KEYS, DSparkDraftConfig, serving_config
from sparkforge.trainer.draft.heads import head_shapes

if TYPE_CHECKING:
    from sparkforge.trainer.architectures import Engine


def serving_problems(cfg: DSparkDraftConfig, engine: Engine) -> list[str]:
    """Reasons ``engine`` could not serve this draft correctly (empty when it can)."""
    return backbone_problems(cfg, engine) + head_problems(cfg, engine)


def dspark_problems(cfg: DSparkDraftConfig, engine: Engine) -> list[str]:
    """Serving problems of the DSpark parts every DSpark format shares (ids, mask, heads)."""
    return id_problems(cfg, engine) + head_problems(cfg, engine)


def backbone_problems(cfg: DSparkDraftConfig, engine: Engine) -> list[str]:
    """What ``engine`` cannot serve in any Qwen3-shaped format (DSpark or DFlash) for this draft."""
    problems = id_problems(cfg, engine)
    if cfg.embedding_scale != 1.0 or cfg.final_logit_softcapping:
        problems.append("the draft uses a Gemma-style embedding scale or logit softcap, which the "
                        "Qwen3-shaped serving format cannot express (use architecture 'gemma4')")
    return problems


def id_problems(cfg: DSparkDraftConfig, engine: Engine) -> list[str]:
    """Feature ids and mask id ``engine`` can serve as trained."""
    problems = []
    lo, hi = every_engine_feature_range(cfg.num_target_layers)
    if any(i < lo for i in cfg.target_layer_ids):
        problems.append("target_layer_ids holds -1 (the embeddings): no cache holds it, and "
                        "SGLang cannot capture it")
    if engine in ("sglang", "any") and any(i > hi for i in cfg.target_layer_ids):
        problems.append(f"target_layer_ids holds {hi + 1}, the last layer: SGLang cannot capture "
                        "it (vLLM serves it as the layer's raw output, which the cache holds)")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        problems.append(f"mask_token_id={cfg.mask_token_id} must be below "
                        f"vocab_size={cfg.vocab_size}")
    return problems


def head_problems(cfg: DSparkDraftConfig, engine: Engine) -> list[str]:
    """Markov and confidence heads an engine would build differently from the trained ones."""
    problems = []
    if engine in ("vllm", "any"):
        if cfg.markov_rank == 0:
            problems.append("markov_rank=0: vLLM's DSpark draft has no rank-0 path (markov_rank "
                            "must be > 0)")
        elif cfg.markov_head_type != "vanilla":
            problems.append(f"markov_head_type={cfg.markov_head_type!r}: vLLM builds only the "
                            "vanilla Markov head and fails to load gated/rnn weights")
    if engine in ("sglang", "any") and not cfg.enable_confidence_head:
        problems.append("enable_confidence_head=False: SGLang builds the confidence head anyway "
                        "and refuses a draft without its weights")
    return problems


def hf_config(cfg: DSparkDraftConfig) -> dict[str, Any]:
    """``config.json`` contents: a Qwen3Config with the DSpark fields."""
    from transformers import Qwen3Config

    fields = serving_config(cfg)
    fields["max_window_layers"] = cfg.num_hidden_layers
    out: dict[str, Any] = Qwen3Config(**fields, dtype="bfloat16").to_dict()
    assert out["model_type"] == "qwen3", out["model_type"]
    assert out["architectures"] == ["Qwen3DSparkModel"], out["architectures"]
    return out


def expected_shapes(cfg: DSparkDraftConfig) -> dict[str, tuple[int, ...]]:
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
    return shapes | head_shapes(cfg)


def draft_config_from_hf(config: Mapping[str, Any]) -> DSparkDraftConfig:
    """Read a DSpark ``config.json`` (ours, DeepSpec's or NeMo's Qwen3-shaped drafts)."""
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "rms_norm_eps", "rope_parameters",
            "max_position_embeddings", "attention_bias", "num_hidden_layers",
            "initializer_range", *DSPARK_KEYS)
    fields = {k: config[k] for k in keys if config.get(k) is not None}
    return DSparkDraftConfig(**fields)
