"""The draft config every architecture shares: generic fields and checks, saved as JSON.

An architecture adds its own fields and checks by subclassing ``SharedDraftConfig`` (see
``sparkforge.trainer.architectures.config``, whose subclass is the draft config, ``DraftConfig``;
this base was once ``DraftConfig``); nothing here names an architecture. The block
layout is a generic field (``block_layout``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self, get_args

from sparkforge.shared.errors import ConfigError
from sparkforge.shared.layer_ids import (
    default_feature_ids,
    existing_feature_range,
    portable_feature_range,
    range_problems,
)
from sparkforge.shared.renamed import renamed_attribute
from sparkforge.shared.target_config import TargetConfig
from sparkforge.shared.target_families import family_of
from sparkforge.trainer.draft.block_layout import BLOCK_LAYOUTS, Layout, layout_problems

logger = logging.getLogger(__name__)

MarkovHeadType = Literal["vanilla", "gated", "rnn"]
MARKOV_HEAD_TYPES: tuple[str, ...] = get_args(MarkovHeadType)


@dataclass(frozen=True, kw_only=True)
class SharedDraftConfig:
    """Everything needed to build the draft: sizes from the target, DSpark fields from the run."""
    mask_token_id: int
    """Unused in-vocabulary id filling the non-anchor block slots; the same id must serve."""
    target_layer_ids: tuple[int, ...]
    """0-based DSpark feature ids (id l = HF hidden_states[l+1]), strictly increasing."""
    num_target_layers: int
    """The target's num_hidden_layers (L); persisted because SGLang validates ids against it."""
    hidden_size: int
    """H, the target's hidden size (the draft shares embed_tokens and lm_head with it)."""
    num_attention_heads: int
    """Query heads of each draft layer (from the target)."""
    num_key_value_heads: int
    """Key/value heads of each draft layer (GQA; from the target)."""
    head_dim: int
    """Per-head size, even for RoPE (from the target)."""
    intermediate_size: int
    """MLP width of each draft layer (from the target)."""
    vocab_size: int
    """V, the target's vocabulary size."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (from the target)."""
    rope_parameters: Mapping[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0}
    )
    """HF-5 style RoPE settings copied from the target (rope_type, rope_theta, scaling keys)."""
    max_position_embeddings: int = 40_960
    """Longest position the RoPE settings are meant for (scaled RoPE types read it)."""
    attention_bias: bool = False
    """Bias on the q/k/v projections (from the target)."""
    initializer_range: float = 0.02
    """Std of the normal init of Linear and Embedding weights (from the target)."""
    num_hidden_layers: int = 5
    """Draft depth."""
    block_size: int = 7
    """K: the block's query slots (anchor + K-1 masks). DSpark drafts K tokens per pass (the
    anchor slot predicts anchor+1), DFlash K-1 (slot k predicts the token at anchor+k)."""
    num_anchors: int = 512
    """A: blocks sampled per sequence in training (fixed count, dummies padded)."""
    layout: Layout = "dspark"
    """The block layout (``block_layout.Layout``): ``dspark`` (K drafts per block, Markov and
    confidence heads), ``dflash`` (the anchor slot drafts nothing, so K-1 drafts and K >= 2;
    whole-block anchors; no heads) or ``dflash2`` (DFlash's block with a dynamic causal
    convolution around every sublayer and the top-k candidate selector head), on any
    architecture's backbone."""
    markov_rank: int = 256
    """r: rank of the Markov bigram bias; 0 disables the head."""
    markov_head_type: MarkovHeadType = "vanilla"
    """vanilla (the only type serving engines build), gated or rnn."""
    enable_confidence_head: bool = True
    """Build the per-slot acceptance predictor."""
    confidence_head_with_markov: bool = True
    """Confidence features [h ; W1[prev]] when true (requires r > 0), h alone when false."""
    conv_kernel_size: int = 2
    """DFlash2: taps of each block convolution (the slot itself and the ones before it)."""
    conv_group_size: int = 16
    """DFlash2: hidden channels sharing one token-dependent kernel coefficient."""
    selector_rank: int = 256
    """DFlash2: rank of the candidate selector's predecessor/successor codebooks."""
    selector_top_k: int = 16
    """DFlash2: candidates (the base logits' top-k) the selector reranks at each draft slot."""
    embedding_scale: float = 1.0
    """Multiplier on embed_tokens output (Gemma: sqrt(hidden_size)); taken from the target type."""
    final_logit_softcapping: float | None = None
    """tanh softcap on lm_head logits (Gemma); applied to draft base logits and teacher logits."""
    target_model_type: str = "qwen3"
    """The target's HF model_type, recorded with the draft."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        object.__setattr__(self, "rope_parameters", dict(self.rope_parameters))
        problems = self.problems()
        if problems:
            raise ConfigError(f"invalid {type(self).__name__}:\n  " + "\n  ".join(problems))
        _warn_layer_ids(self.target_layer_ids, self.num_target_layers)

    def problems(self) -> list[str]:
        """Every reason this config is invalid (empty when it is valid); subclasses extend it."""
        return _generic_problems(self)

    @property
    def num_features(self) -> int:
        """F: number of captured target layers concatenated into the fc input."""
        return len(self.target_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        data = dataclasses.asdict(self)
        data["target_layer_ids"] = list(self.target_layer_ids)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Inverse of to_dict; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown {cls.__name__} keys: {unknown}")
        return cls(**dict(data))

    def save(self, path: str | Path) -> None:
        """Write the config as indented JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read a config written by save."""
        return cls.from_dict(json.loads(Path(path).read_text()))


def _generic_problems(cfg: SharedDraftConfig) -> list[str]:
    problems = []
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        problems.append(
            f"mask_token_id={cfg.mask_token_id} must be in [0, vocab_size={cfg.vocab_size})"
        )
    problems += range_problems(cfg.target_layer_ids, existing_feature_range(cfg.num_target_layers),
                               name="target_layer_ids")
    positive = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "num_hidden_layers", "block_size",
                "num_anchors")
    for name in positive:
        if getattr(cfg, name) <= 0:
            problems.append(f"{name}={getattr(cfg, name)} must be > 0")
    if cfg.num_key_value_heads > 0 and cfg.num_attention_heads % cfg.num_key_value_heads:
        problems.append(
            f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )
    if cfg.markov_rank < 0:
        problems.append(f"markov_rank={cfg.markov_rank} must be >= 0")
    if cfg.markov_head_type not in MARKOV_HEAD_TYPES:
        problems.append(f"markov_head_type={cfg.markov_head_type!r} not in {MARKOV_HEAD_TYPES}")
    if cfg.enable_confidence_head and cfg.confidence_head_with_markov and cfg.markov_rank == 0:
        problems.append("confidence_head_with_markov=True needs markov_rank > 0")
    if cfg.head_dim % 2:
        problems.append(f"head_dim={cfg.head_dim} must be even for RoPE")
    return problems + layout_problems(cfg)


def _warn_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> None:
    # Id -1 (the embeddings) exists but no cache holds it; see sparkforge.shared.layer_ids for
    # the range rule.
    lo, hi = portable_feature_range(num_target_layers)
    for bad in layer_ids:
        if not lo <= bad <= hi:
            logger.warning("target_layer_ids contains %d: keep ids in [%d, %d], the ones a cache "
                           "holds", bad, lo, hi)


def text_config(target_config: Any) -> Any:
    """The text sub-config of a multimodal target (``text_config``), or the config itself."""
    sub = getattr(target_config, "text_config", None)
    return sub if sub is not None else target_config


def _as_mapping(config: Any) -> dict[str, Any]:
    """A config's fields as JSON-like data: a transformers config or a plain namespace."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    sub = data.get("text_config")
    if sub is not None and not isinstance(sub, Mapping):
        data["text_config"] = _as_mapping(sub)
    return data


def target_fields(target_config: Any, *, depth: int) -> dict[str, Any]:
    """The generic draft fields copied from a target HF config (nested ``text_config`` handled).

    Attention sizes and RoPE are those of the target's full-attention layers (Gemma4 sizes them
    per layer; see ``TargetConfig.attention``). Gemma targets give the sqrt(H) embedding scale
    and their final logit softcap. ``target_layer_ids`` is the DFlash rule for ``depth`` layers.
    """
    tc = text_config(target_config)
    # Per-layer and derived facts (Gemma4's full-attention sizes and RoPE, the embedding scale,
    # the softcap) are read from the config's JSON form by the one target-config reader; plain
    # sizes from the config object, whose properties also derive sizes its JSON leaves null.
    target = TargetConfig(raw=_as_mapping(target_config), source="target config")
    attention = target.attention
    model_type = target_model_type(target_config)
    family = family_of(model_type)
    heads = int(tc.num_attention_heads)
    rope = attention.get("rope_parameters") or {
        "rope_type": "default", "rope_theta": float(getattr(tc, "rope_theta", 10_000.0))
    }
    if family.rope_section is not None:
        # Per-layer-type RoPE (DeepSeek-V4): the draft's full RoPE uses the main section's base.
        section = rope[family.rope_section]
        rope = {"rope_type": section.get("rope_type", "default"),
                "rope_theta": float(section["rope_theta"])}
    return {
        "hidden_size": int(tc.hidden_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(attention.get("num_key_value_heads") or heads),
        "head_dim": target.head_dim(),
        "intermediate_size": int(tc.intermediate_size),
        "vocab_size": int(tc.vocab_size),
        "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
        "rope_parameters": dict(rope),
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 40_960)),
        "attention_bias": bool(getattr(tc, "attention_bias", False)),
        "initializer_range": float(getattr(tc, "initializer_range", 0.02)),
        "num_target_layers": int(tc.num_hidden_layers),
        "embedding_scale": target.embedding_scale,
        "final_logit_softcapping": target.final_logit_softcapping,
        "target_model_type": model_type,
        "target_layer_ids": default_feature_ids(int(tc.num_hidden_layers), depth),
    }


def target_model_type(target_config: Any) -> str:
    """The target's HF ``model_type`` (its text config's, when it has one)."""
    tc = text_config(target_config)
    return str(getattr(tc, "model_type", "") or getattr(target_config, "model_type", ""))


def dspark_fields(cfg: SharedDraftConfig) -> dict[str, Any]:
    """The DSpark fields every served ``config.json`` carries, whatever its backbone."""
    out: dict[str, Any] = {
        "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "num_target_layers": cfg.num_target_layers, "markov_rank": cfg.markov_rank,
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.enable_confidence_head
        and cfg.confidence_head_with_markov,
        "num_anchors": cfg.num_anchors,
    }
    if cfg.markov_rank > 0:
        out["markov_head_type"] = cfg.markov_head_type
    return out


DSPARK_KEYS: tuple[str, ...] = (
    "block_size", "num_anchors", "markov_rank", "markov_head_type", "enable_confidence_head",
    "confidence_head_with_markov", "mask_token_id", "target_layer_ids", "num_target_layers")
"""The DSpark fields a served ``config.json`` is read back with (see ``dspark_fields``)."""


def layout_shapes(cfg: SharedDraftConfig) -> dict[str, tuple[int, ...]]:
    """The exported tensors the block layout adds to a backbone's, and their shapes: the Markov
    and confidence heads (DSpark), every layer's two block convolutions and the candidate
    selector (DFlash2)."""
    h, v, r = cfg.hidden_size, cfg.vocab_size, cfg.markov_rank
    shapes: dict[str, tuple[int, ...]] = {}
    if r > 0:
        shapes |= {"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)}
    if cfg.enable_confidence_head:
        width = h + (r if cfg.confidence_head_with_markov and r > 0 else 0)
        shapes |= {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}
    layout = BLOCK_LAYOUTS[cfg.layout]
    if layout.block_convs:
        taps, groups = cfg.conv_kernel_size, h // cfg.conv_group_size
        for layer in range(cfg.num_hidden_layers):
            for conv in ("attention_conv", "mlp_conv"):
                p = f"layers.{layer}.{conv}."
                shapes |= {p + "base_kernel": (2, taps, h),
                           p + "kernel_projection.weight": (2 * taps * groups, h)}
    if layout.candidate_selector:
        rank = cfg.selector_rank
        shapes |= {"candidate_selector.predecessor_codebook": (v, rank),
                   "candidate_selector.successor_codebook": (v, rank),
                   "candidate_selector.hidden_projection.weight": (rank, h)}
    return shapes


RENAMED = {"DraftConfig": "SharedDraftConfig"}
"""Old names this module still serves, each as its new name (``renamed_attribute``): the full
draft config took the name ``DraftConfig`` in ``sparkforge.trainer.architectures.config``."""


def __getattr__(name: str) -> Any:
    """An old name of ``RENAMED``, with a FutureWarning naming its replacement."""
    return renamed_attribute(__name__, name, RENAMED)
