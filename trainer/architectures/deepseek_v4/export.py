"""The DeepSeek-V4 draft's tensors, and why no engine can serve it as exported today.

vLLM (and SGLang) serve a V4 DSpark draft only in DeepSeek's built-in format: ``mtp.{i}.*``
stages inside the target checkpoint, each a full V4 decoder layer. That layer mixes
hyper-connection streams (``hc_attn_*``, ``hc_ffn_*``, and ``hc_head_*`` on the last stage),
routes tokens through experts (``ffn.gate``, ``ffn.experts.*``) and attends to a sliding window
of the context. The ``deepseek_v4`` draft (NeMo's layout) is dense, has one residual stream and
attends to the whole context, and the stages run with the target checkpoint's quantization, so no
renaming of its tensors makes an engine compute what it learned: export refuses it, naming these
reasons. Its checkpoint still trains and evaluates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sparkforge.shared.errors import SparkforgeError
from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.deepseek_v4.config import v4_options
from sparkforge.trainer.draft.config import layout_shapes

if TYPE_CHECKING:
    from sparkforge.trainer.architectures import Engine

NOT_SERVABLE = (
    "architecture='deepseek_v4': vLLM and SGLang serve a DeepSeek-V4 DSpark draft only as "
    "mtp.{i} stages of the target checkpoint, each a full V4 decoder layer with hyper-connection "
    "mixing (hc_attn_*, hc_ffn_*, hc_head_*), routed experts (ffn.gate, ffn.experts.*) and "
    "sliding-window attention; this dense single-stream draft has none of them and attends to "
    "the whole context, so a pack would have to invent those tensors and would still serve "
    "another attention window. The stages also take the target checkpoint's quantization (FP8 "
    "in the released V4 checkpoints), so bf16 draft tensors would be re-quantized, not loaded as "
    "trained. Train "
    "architecture='qwen3' to serve a V4 target (vLLM's Qwen3DSparkForCausalLM loads it)",
    "vLLM 0.32's CPU build has no V4 DSpark class (its CPU DSparkDeepseekV4ForCausalLM raises "
    "NotImplementedError, and the CUDA class asserts a CUDA device while building its "
    "attention), so no load of such an artifact can be checked without a GPU",
)


def serving_problems(cfg: DraftConfig, engine: Engine) -> list[str]:
    """Why ``engine`` cannot serve this draft: always the reasons in ``NOT_SERVABLE``."""
    return list(NOT_SERVABLE)


def refuse_hf_config(cfg: DraftConfig) -> dict[str, Any]:
    """No exported ``config.json`` exists for this architecture (see ``NOT_SERVABLE``)."""
    raise SparkforgeError("cannot write a serving config: " + "; ".join(NOT_SERVABLE))


def refuse_config_from_hf(config: Mapping[str, Any]) -> DraftConfig:
    """No exported ``config.json`` exists for this architecture (see ``NOT_SERVABLE``)."""
    raise SparkforgeError("no exported deepseek_v4 draft exists to read: "
                          + "; ".join(NOT_SERVABLE))


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every trained tensor of the draft and its shape (13 per layer + 3 + the heads)."""
    h, n, d, i_sz = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.intermediate_size
    opts = v4_options(cfg)
    qr, lo = opts.q_lora_rank, opts.o_groups * opts.o_lora_rank
    shapes: dict[str, tuple[int, ...]] = {
        "main_proj.weight": (h, cfg.num_features * h), "main_norm.weight": (h,),
        "norm.weight": (h,)}
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        shapes |= {
            p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,),
            p + "attn.wq_a.weight": (qr, h), p + "attn.q_norm.weight": (qr,),
            p + "attn.wq_b.weight": (n * d, qr), p + "attn.wkv.weight": (d, h),
            p + "attn.kv_norm.weight": (d,), p + "attn.wo_a.weight": (lo, n * d // opts.o_groups),
            p + "attn.wo_b.weight": (h, lo), p + "attn.attn_sink": (n,),
            p + "ffn.shared_experts.w1.weight": (i_sz, h),
            p + "ffn.shared_experts.w3.weight": (i_sz, h),
            p + "ffn.shared_experts.w2.weight": (h, i_sz),
        }
    return shapes | layout_shapes(cfg)
