"""The Gemma4 DSpark serving format: the self-contained draft vLLM's ``Gemma4DSparkForCausalLM``
loads.

``config.json`` is a ``transformers.Gemma4TextConfig`` (``model_type: gemma4_text``,
``architectures: ["Gemma4DSparkModel"]``) whose layers are all ``full_attention`` with
``attention_k_eq_v``, plus the DSpark fields. vLLM reads each layer's head size and KV heads from
``per_layer_config`` (built from ``global_head_dim`` / ``num_global_key_value_heads``), scales the
embedding by sqrt(hidden_size) and softcaps logits with ``final_logit_softcapping``. Tensor keys
are bare, 12 per layer (no ``v_proj``; ``v_norm`` has no weight); ``embed_tokens`` and
``lm_head`` are required because this loader never shares the target's. It ignores unknown keys
and never reports missing ones, so the exporter's exact key-set check is the only guard.

SGLang has no Gemma4 DSpark loader. vLLM 0.32 passes the Markov bias through the same softcapped
logits processor as the base logits, so it serves ``softcap(base) + softcap(bias)`` where the
draft trains ``softcap(base) + bias`` (equal up to ``bias^3 / (3 cap^2)``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sparkforge.shared.target_config import FULL_ATTENTION, TargetConfig
from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.serving import dspark_problems
from sparkforge.trainer.draft.config import DSPARK_KEYS, dspark_fields, layout_shapes

if TYPE_CHECKING:
    from sparkforge.trainer.architectures import Engine

logger = logging.getLogger(__name__)

HIDDEN_ACTIVATION = "gelu_pytorch_tanh"
"""The Gemma4 MLP activation the draft uses and the served config names."""


def serving_problems(cfg: DraftConfig, engine: Engine) -> list[str]:
    """Reasons ``engine`` could not serve this draft correctly (empty when it can)."""
    problems = dspark_problems(cfg, engine)
    if engine in ("sglang", "any"):
        problems.append("SGLang has no Gemma4 DSpark loader: export a gemma4 draft with "
                        "--engine vllm")
    if not math.isclose(cfg.embedding_scale, math.sqrt(cfg.hidden_size), rel_tol=1e-6):
        problems.append(f"embedding_scale={cfg.embedding_scale}: vLLM's Gemma4 draft always "
                        f"scales the embedding by sqrt(hidden_size)={math.sqrt(cfg.hidden_size)}")
    return problems


def hf_config(cfg: DraftConfig) -> dict[str, Any]:
    """``config.json`` contents: a Gemma4TextConfig of full k_eq_v layers with the DSpark fields."""
    from transformers import Gemma4TextConfig

    if cfg.final_logit_softcapping:
        logger.warning("vLLM 0.32 softcaps the Markov bias as well as the base logits "
                       "(final_logit_softcapping=%s); training adds the bias uncapped",
                       cfg.final_logit_softcapping)
    layers = cfg.num_hidden_layers
    # Init-only keywords from which Gemma4TextConfig builds each layer's per_layer_config.
    per_layer: dict[str, Any] = {"global_head_dim": cfg.head_dim,
                                 "num_global_key_value_heads": cfg.num_key_value_heads}
    out: dict[str, Any] = Gemma4TextConfig(
        architectures=["Gemma4DSparkModel"], vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, **per_layer,
        attention_k_eq_v=True, layer_types=[FULL_ATTENTION] * layers,
        hidden_activation=HIDDEN_ACTIVATION, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={FULL_ATTENTION: dict(cfg.rope_parameters)},
        max_position_embeddings=cfg.max_position_embeddings, attention_bias=cfg.attention_bias,
        final_logit_softcapping=cfg.final_logit_softcapping, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=cfg.vocab_size, tie_word_embeddings=False,
        initializer_range=cfg.initializer_range, dtype="bfloat16", **dspark_fields(cfg),
    ).to_dict()
    assert out["model_type"] == "gemma4_text", out["model_type"]
    return out


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every required tensor and its shape: 12 per layer (+ biases), the heads, embed, lm_head."""
    h, hd, i_sz, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
        "fc.weight": (h, cfg.num_features * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "pre_feedforward_layernorm.weight": (h,),
            p + "post_feedforward_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq, h), p + "self_attn.k_proj.weight": (nkv, h),
            p + "self_attn.o_proj.weight": (h, nq),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (i_sz, h), p + "mlp.up_proj.weight": (i_sz, h),
            p + "mlp.down_proj.weight": (h, i_sz),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (nq,), p + "self_attn.k_proj.bias": (nkv,),
                       p + "self_attn.o_proj.bias": (h,)}
    return shapes | layout_shapes(cfg)


def draft_config_from_hf(config: Mapping[str, Any]) -> DraftConfig:
    """Read a Gemma4 DSpark ``config.json`` (ours or DeepSpec's) back into a draft config."""
    attention = TargetConfig(raw=config, source="config.json").attention
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "rms_norm_eps", "rope_parameters",
            "max_position_embeddings", "attention_bias", "num_hidden_layers",
            "initializer_range", "final_logit_softcapping", *DSPARK_KEYS)
    fields = {k: attention[k] for k in keys if attention.get(k) is not None}
    return DraftConfig(**fields, embedding_scale=math.sqrt(fields["hidden_size"]),
                             architecture="gemma4")
