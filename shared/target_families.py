"""What each target family means to the pipeline, in one torch-free table keyed by ``model_type``.

A family says where its pieces live in the checkpoint (the names the architecture itself uses),
what a captured feature and the final state are, and how vLLM numbers its DSpark layer ids. The
producer's target-file code, its capture backends and the trainer's draft-config builder all read
this table, so adding a family is one entry here rather than branches spread over modules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from sparkforge.shared.errors import SparkforgeError

FeatureSemantics = Literal["residual", "hc_mean"]
"""``residual``: the residual stream after a layer. ``hc_mean``: the mean over hyper-connection
streams of a layer's output (HF ``hidden_states[l + 1]`` is ``[B, S, hc_mult, H]``)."""
FinalSemantics = Literal["post_norm", "lm_head_input"]
"""``post_norm``: ``RMSNorm(h_L) * w`` of the last residual, which is what lm_head consumes.
``lm_head_input``: the exact tensor lm_head consumed (before any logit softcap), for families
where it is not ``RMSNorm(h_L) * w`` of the last residual: DeepSeek-V4 collapses its streams with
``hc_head`` before the norm, Gemma has its own final norm, Kimi-K3 folds its block residuals after
the last layer, Qwen3-Next/3.5 and MiniMax-M3 scale by ``1 + w``."""
FEATURE_SEMANTICS: tuple[FeatureSemantics, ...] = ("residual", "hc_mean")
FINAL_SEMANTICS: tuple[FinalSemantics, ...] = ("post_norm", "lm_head_input")


@dataclass(frozen=True, kw_only=True)
class TargetScaling:
    """What the target does around its transformer stack that a draft must repeat.

    Recorded in the manifest's capture section (``capture.embedding_scale``,
    ``capture.final_logit_softcapping``) so the trainer and ``validate --against`` can check a
    draft against the target that made the cache.
    """

    embedding_scale: float = 1.0
    """Factor on the embed_tokens output: ``sqrt(hidden_size)`` for Gemma, 1.0 otherwise."""
    final_logit_softcapping: float | None = None
    """``logits = cap * tanh(logits / cap)`` after lm_head (Gemma); None: no cap."""


@dataclass(frozen=True, kw_only=True)
class TargetFamily:
    """One family of target architectures."""

    name: str
    """Short name shown in errors."""
    model_types: tuple[str, ...]
    """HF ``model_type`` values of the family (the top-level one for multimodal checkpoints)."""
    pieces: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: {
        "embed_tokens.weight": ("embed_tokens.weight",), "lm_head.weight": ("lm_head.weight",),
        "norm.weight": ("norm.weight",)})
    """Cache name of each target weight the trainer needs -> the checkpoint name endings that
    hold it, in preference order. An ending matches a whole dotted name or its tail after a dot
    (``norm.weight`` matches ``model.language_model.norm.weight``, never ``q_norm.weight``);
    per-layer and MTP weights never match, and the shortest match wins. ``embed_tokens.weight``,
    ``lm_head.weight`` and ``norm.weight`` are always present."""
    features: FeatureSemantics = "residual"
    final_state: FinalSemantics = "post_norm"
    vllm_dspark_id_offset: int = 1
    """vLLM aux id of DSpark feature id ``l`` when read from ``dspark_target_layer_ids``:
    ``l + 1`` for every family except DeepSeek-V4.1, whose ids vLLM uses as they are."""
    embedding_scale_sqrt_hidden: bool = False
    """The target scales embed_tokens output by sqrt(hidden_size) (Gemma); the draft does too."""
    padding_sensitive: bool = False
    """transformers gives a right-padded row other states than the same row alone, so the HF
    backend forwards such rows one at a time. GLM-5's sparse-attention indexer keeps the top-k
    keys by a ReLU-clipped score: exact ties at 0 are common, and which tied key ``topk`` keeps
    depends on the length of the (padded) key axis; measured rel. error 0.2 over 4 tiny layers."""
    chunk_sensitive: bool = False
    """transformers gives a row forwarded in chunks over a KV cache other states than the row
    forwarded whole, so the HF backend forwards long rows of this family whole. GLM-5's
    sparse-attention indexer: measured rel. error 1.0 over 4 tiny layers (200 tokens in chunks
    of 48; every other family of the table within 1.1e-5)."""
    image_text_top_levels: tuple[str, ...] = ()
    """Multimodal top-level model types that transformers loads only as image-text models (no
    causal-LM class); their forward on text ids gives the text model's hidden states."""
    rope_section: str | None = None
    """Key of the RoPE settings the draft copies when ``rope_parameters`` is nested per layer
    type (DeepSeek-V4: ``main``); None when it is flat."""

    @property
    def final_from_residual(self) -> bool:
        """True when ``RMSNorm(h_L) * w`` is the lm_head input, so the vLLM backend can finish
        its pre-norm aux id ``L`` offline; otherwise it captures the lm_head input itself."""
        return self.final_state == "post_norm"

    def scaling(self, text_config: Mapping[str, Any]) -> TargetScaling:
        """The embedding scale and logit softcap of a target of this family (its text config)."""
        softcap = text_config.get("final_logit_softcapping")
        hidden = text_config.get("hidden_size")
        scale = 1.0
        if self.embedding_scale_sqrt_hidden:
            if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1:
                raise SparkforgeError(f"{self.name} target: hidden_size must be a positive integer "
                                      f"(its embedding scale is sqrt(hidden_size)), got {hidden!r}")
            scale = math.sqrt(hidden)
        if softcap is not None and (isinstance(softcap, bool) or not isinstance(
                softcap, int | float) or not softcap > 0):
            raise SparkforgeError(f"{self.name} target: final_logit_softcapping must be a positive "
                                  f"number or null, got {softcap!r}")
        return TargetScaling(embedding_scale=scale, final_logit_softcapping=(
            None if softcap is None else float(softcap)))


# DeepSeek-V4 names its output projection ``head.weight`` and its embedding ``embed.weight`` in
# the released checkpoints (transformers 5.19 saves ``head.weight``, ``model.embed_tokens.weight``
# and ``model.hc_head.hc_*``); its lm_head input is ``norm(hc_head(streams))``, so the final state
# needs the hc_head weights too.
_V4_PIECES = {
    "embed_tokens.weight": ("embed_tokens.weight", "embed.weight"),
    "lm_head.weight": ("head.weight", "lm_head.weight"),
    "norm.weight": ("norm.weight",),
    "hc_head.hc_fn": ("hc_head.hc_fn", "hc_head_fn"),
    "hc_head.hc_base": ("hc_head.hc_base", "hc_head_base"),
    "hc_head.hc_scale": ("hc_head.hc_scale", "hc_head_scale"),
}

STANDARD = TargetFamily(name="standard", model_types=())
"""Llama/Qwen-style targets (and any model_type not listed): plain residual, post-norm final."""
FAMILIES: tuple[TargetFamily, ...] = (
    TargetFamily(name="qwen3", model_types=("qwen3", "qwen3_moe")),
    # Qwen3-Next and Qwen3.5 (hybrid Gated DeltaNet attention) scale their final norm by (1 + w),
    # so the plain RMSNorm the vLLM backend applies to aux id L would not give the lm_head input.
    TargetFamily(name="qwen3_next", model_types=("qwen3_next", "qwen3_5", "qwen3_5_text",
                                                 "qwen3_5_moe", "qwen3_5_moe_text"),
                 final_state="lm_head_input"),
    TargetFamily(name="gemma", model_types=("gemma", "gemma2", "gemma3", "gemma3_text", "gemma4",
                                            "gemma4_text", "gemma4_unified", "gemma4_unified_text"),
                 final_state="lm_head_input", embedding_scale_sqrt_hidden=True),
    TargetFamily(name="deepseek_v4", model_types=("deepseek_v4",), pieces=_V4_PIECES,
                 features="hc_mean", final_state="lm_head_input", rope_section="main"),
    TargetFamily(name="deepseek_v41", model_types=("deepseek_v41",), pieces=_V4_PIECES,
                 features="hc_mean", final_state="lm_head_input", vllm_dspark_id_offset=0,
                 rope_section="main"),
    TargetFamily(name="kimi_k3", model_types=("kimi_k3", "kimi_linear"),
                 final_state="lm_head_input"),
    TargetFamily(name="glm_dsa", model_types=("glm_moe_dsa",), padding_sensitive=True,
                 chunk_sensitive=True),
    # MiniMax-M3's final norm scales by (1 + w): not the plain RMSNorm the vLLM backend applies.
    TargetFamily(name="minimax_m3", model_types=("minimax_m3_vl", "minimax_m3_vl_text"),
                 final_state="lm_head_input", image_text_top_levels=("minimax_m3_vl",)),
)


def family_of(model_type: str | None) -> TargetFamily:
    """The family of an HF ``model_type``; unknown types get the standard Llama/Qwen family."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    return STANDARD


def family_of_config(config: Mapping[str, Any]) -> TargetFamily:
    """The family of a ``config.json`` mapping (its top-level ``model_type``)."""
    return family_of(config.get("model_type"))


def loads_as_image_text(model_type: str | None) -> bool:
    """Whether transformers loads ``model_type`` with its image-text auto class, not the causal-LM
    one (a multimodal top level that has no causal-LM class)."""
    return model_type in family_of(model_type).image_text_top_levels
