"""The Kimi-K3 DSpark serving format: the dense MLA draft vLLM's ``K3DSparkForCausalLM`` loads.

``config.json`` is a DeepSeek-V3-style config with ``model_type: k3_dspark`` and
``architectures: ["K3DSparkModel"]`` (vLLM reads it as its ``K3DSparkConfig``): dense (no
experts), a query bottleneck (``q_lora_rank`` is required), the MLA sizes, and the DSpark
fields, with two differences from the other formats: ``num_target_layers`` is the number of
captured features (``len(target_layer_ids)``, which vLLM checks), not the target's depth, and
``target_hidden_size`` sizes ``context_proj``'s input. The target's depth is kept as
``target_num_hidden_layers`` so the draft reads back. vLLM's K3 MLA rotates the rope channels in
adjacent pairs with plain RoPE only for ``rope_type: default`` (other types become DeepSeek
YaRN with its own softmax scale), so the draft must use the default type.

Tensor keys are bare: ``context_proj``, ``context_norm``, ``final_norm``, 11 per layer, the
heads. vLLM stacks ``q_a_proj`` and ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``, copies
every layer's ``kv_a_proj_with_mqa`` into one ``context_kv_proj``, stacks gate/up, and drops
``embed_tokens``/``lm_head`` (it shares the target's), so those two are optional. It ignores
unknown keys and never reports missing ones: the exporter's exact key-set check is the guard.
SGLang has no K3 DSpark loader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.kimi_k3.config import KimiK3Options, k3_options
from sparkforge.trainer.architectures.serving import dspark_problems
from sparkforge.trainer.draft.config import DSPARK_KEYS, dspark_fields, layout_shapes

if TYPE_CHECKING:
    from sparkforge.trainer.architectures import Engine

SERVED_AS = "K3DSparkModel"
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
TARGET_DEPTH_KEY = "target_num_hidden_layers"
"""Our ``config.json`` key for the target's depth (vLLM's ``num_target_layers`` is the feature
count)."""


def serving_problems(cfg: DraftConfig, engine: Engine) -> list[str]:
    """Reasons ``engine`` could not serve this draft correctly (empty when it can)."""
    problems = dspark_problems(cfg, engine)
    if engine in ("sglang", "any"):
        problems.append("SGLang has no Kimi-K3 DSpark loader: export a kimi_k3 draft with "
                        "--engine vllm")
    rope_type = cfg.rope_parameters.get("rope_type", "default")
    if rope_type != "default":
        problems.append(f"rope_parameters.rope_type={rope_type!r}: vLLM's K3 MLA serves "
                        "non-default RoPE as DeepSeek YaRN with its own softmax scale; train "
                        "the draft with rope_type 'default'")
    if cfg.embedding_scale != 1.0 or cfg.final_logit_softcapping:
        problems.append("the draft uses an embedding scale or logit softcap, which vLLM's K3 "
                        "draft (the target's plain embedding and lm_head) does not apply")
    return problems


def hf_config(cfg: DraftConfig) -> dict[str, Any]:
    """``config.json`` contents: a dense DeepSeek-V3-style MLA config read as ``k3_dspark``."""
    from transformers import DeepseekV3Config

    layers = cfg.num_hidden_layers
    out: dict[str, Any] = DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, hidden_act="silu",
        **{k: getattr(k3_options(cfg), k) for k in MLA_KEYS},
        n_routed_experts=0, n_shared_experts=0, num_experts_per_tok=0,
        first_k_dense_replace=layers, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=dict(cfg.rope_parameters),
        max_position_embeddings=cfg.max_position_embeddings, attention_bias=False,
        tie_word_embeddings=False, initializer_range=cfg.initializer_range, dtype="bfloat16",
    ).to_dict()
    out |= {"model_type": "k3_dspark", "architectures": [SERVED_AS], **dspark_fields(cfg),
            "num_nextn_predict_layers": 0,
            "num_target_layers": cfg.num_features, TARGET_DEPTH_KEY: cfg.num_target_layers,
            "target_hidden_size": cfg.hidden_size, "draft_vocab_size": cfg.vocab_size}
    return out


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every required tensor and its shape: 11 per layer, the context projection, the heads."""
    h, n, i_sz = cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size
    opts = k3_options(cfg)
    qr, kvr, v = opts.q_lora_rank, opts.kv_lora_rank, opts.v_head_dim
    nope, rope = opts.qk_nope_head_dim, opts.qk_rope_head_dim
    qk = nope + rope
    shapes: dict[str, tuple[int, ...]] = {
        "context_proj.weight": (h, cfg.num_features * h), "context_norm.weight": (h,),
        "final_norm.weight": (h,)}
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_a_proj.weight": (qr, h), p + "self_attn.q_a_layernorm.weight": (qr,),
            p + "self_attn.q_b_proj.weight": (n * qk, qr),
            p + "self_attn.kv_a_proj_with_mqa.weight": (kvr + rope, h),
            p + "self_attn.kv_a_layernorm.weight": (kvr,),
            p + "self_attn.kv_b_proj.weight": (n * (nope + v), kvr),
            p + "self_attn.o_proj.weight": (h, n * v),
            p + "mlp.gate_proj.weight": (i_sz, h), p + "mlp.up_proj.weight": (i_sz, h),
            p + "mlp.down_proj.weight": (h, i_sz),
        }
    return shapes | layout_shapes(cfg)


def draft_config_from_hf(config: Mapping[str, Any]) -> DraftConfig:
    """Read a K3 DSpark ``config.json`` back into a draft config.

    The target's depth is ``target_num_hidden_layers`` when present (ours); a config without it
    is taken to come from a target just deep enough for its ids.
    """
    keys = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
            "rms_norm_eps", "rope_parameters", "max_position_embeddings", "num_hidden_layers",
            "initializer_range", *DSPARK_KEYS)
    fields = {k: config[k] for k in keys if config.get(k) is not None}
    fields["num_target_layers"] = config.get(TARGET_DEPTH_KEY) or max(
        config["target_layer_ids"]) + 1
    options = KimiK3Options(**{k: config[k] for k in MLA_KEYS if config.get(k) is not None})
    return DraftConfig(
        **fields, num_key_value_heads=fields["num_attention_heads"],
        head_dim=options.qk_nope_head_dim + options.qk_rope_head_dim, architecture="kimi_k3",
        options=options)
