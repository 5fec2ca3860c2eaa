"""The DSpark draft config: derived from the target's HF config, validated, saved as JSON."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sparkforge.shared.layer_ids import (
    default_feature_ids,
    existing_feature_range,
    portable_feature_range,
    range_problems,
)
from sparkforge.shared.target_config import TargetConfig
from sparkforge.shared.target_families import family_of

logger = logging.getLogger(__name__)

MarkovHeadType = Literal["vanilla", "gated", "rnn"]
MARKOV_HEAD_TYPES: tuple[str, ...] = ("vanilla", "gated", "rnn")
DRAFT_ARCHITECTURES: tuple[str, ...] = ("qwen3", "deepseek_v4", "dflash", "gemma4", "kimi_k3")
"""Names of ``sparkforge.trainer.architectures.ARCHITECTURES`` (kept torch-free here)."""


@dataclass(frozen=True, kw_only=True)
class DSparkDraftConfig:
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
    markov_rank: int = 256
    """r: rank of the Markov bigram bias; 0 disables the head."""
    markov_head_type: MarkovHeadType = "vanilla"
    """vanilla (the only type serving engines build), gated or rnn."""
    enable_confidence_head: bool = True
    """Build the per-slot acceptance predictor."""
    confidence_head_with_markov: bool = True
    """Confidence features [h ; W1[prev]] when true (requires r > 0), h alone when false."""
    embedding_scale: float = 1.0
    """Multiplier on embed_tokens output (Gemma: sqrt(hidden_size)); taken from the target type."""
    final_logit_softcapping: float | None = None
    """tanh softcap on lm_head logits (Gemma); applied to draft base logits and teacher logits."""
    target_model_type: str = "qwen3"
    """The target's HF model_type, recorded with the draft."""
    architecture: str = "qwen3"
    """The draft's layer stack and serving format (``DRAFT_ARCHITECTURES``): ``qwen3`` is the
    Qwen3-shaped draft every engine loads, for targets of any family; ``deepseek_v4`` follows a
    DeepSeek-V4 target's attention (its sizes below come from that target); ``dflash`` is the
    Qwen3-shaped backbone with the DFlash block layout and no Markov or confidence head, served
    as a DFlash draft (vLLM ``method: dflash``); ``gemma4`` is the Gemma4 draft vLLM's
    ``Gemma4DSparkForCausalLM`` loads (k_eq_v attention, sandwich norms); ``kimi_k3`` is the
    MLA draft vLLM's ``K3DSparkForCausalLM`` loads (its MLA sizes below come from a Kimi
    target)."""
    q_lora_rank: int = 0
    """deepseek_v4, kimi_k3: width of the query low-rank bottleneck (deepseek_v4: wq_a ->
    q_norm -> wq_b; kimi_k3: q_a_proj -> q_a_layernorm -> q_b_proj)."""
    o_lora_rank: int = 0
    """deepseek_v4: low-rank width of each head group's output projection (wo_a)."""
    o_groups: int = 0
    """deepseek_v4: head groups of the grouped output projection."""
    qk_rope_head_dim: int = 0
    """deepseek_v4, kimi_k3: trailing channels of each head that RoPE rotates, in adjacent
    pairs (kimi_k3: the key's rope part, shared by every head)."""
    kv_lora_rank: int = 0
    """kimi_k3: width of the key/value latent (kv_a_proj_with_mqa -> kv_a_layernorm)."""
    qk_nope_head_dim: int = 0
    """kimi_k3: leading channels of each query/key head that RoPE leaves alone."""
    v_head_dim: int = 0
    """kimi_k3: per-head value size (kv_b_proj makes nope keys and values from the latent)."""
    swiglu_limit: float | None = None
    """deepseek_v4: SwiGLU clamp (gate <= limit, -limit <= up <= limit); None: no clamp."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        object.__setattr__(self, "rope_parameters", dict(self.rope_parameters))
        problems = _collect_problems(self)
        if problems:
            raise ValueError("invalid DSparkDraftConfig:\n  " + "\n  ".join(problems))
        _warn_layer_ids(self.target_layer_ids, self.num_target_layers)

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
    def from_dict(cls, data: Mapping[str, Any]) -> DSparkDraftConfig:
        """Inverse of to_dict; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown DSparkDraftConfig keys: {unknown}")
        return cls(**dict(data))

    def save(self, path: str | Path) -> None:
        """Write the config as indented JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> DSparkDraftConfig:
        """Read a config written by save."""
        return cls.from_dict(json.loads(Path(path).read_text()))


def _collect_problems(cfg: DSparkDraftConfig) -> list[str]:
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
    if cfg.architecture not in DRAFT_ARCHITECTURES:
        problems.append(f"architecture={cfg.architecture!r} not in {DRAFT_ARCHITECTURES}")
    if cfg.markov_head_type not in MARKOV_HEAD_TYPES:
        problems.append(f"markov_head_type={cfg.markov_head_type!r} not in {MARKOV_HEAD_TYPES}")
    if cfg.enable_confidence_head and cfg.confidence_head_with_markov and cfg.markov_rank == 0:
        problems.append("confidence_head_with_markov=True needs markov_rank > 0")
    if cfg.architecture == "dflash":
        problems += _dflash_problems(cfg)
    if cfg.head_dim % 2:
        problems.append(f"head_dim={cfg.head_dim} must be even for RoPE")
    if cfg.architecture == "deepseek_v4":
        problems += _deepseek_v4_problems(cfg)
    if cfg.architecture == "kimi_k3":
        problems += _kimi_k3_problems(cfg)
    own = _ARCHITECTURE_FIELDS.get(cfg.architecture, ())
    for name, readers in _FIELD_READERS.items():
        if name not in own and getattr(cfg, name) != _DEFAULTS[name]:
            problems.append(f"{name}={getattr(cfg, name)!r}: only architecture="
                            f"{' or '.join(map(repr, readers))} reads it")
    return problems


def _dflash_problems(cfg: DSparkDraftConfig) -> list[str]:
    """A DFlash draft has neither head, and its anchor slot drafts nothing (so K >= 2)."""
    problems = []
    if cfg.markov_rank:
        problems.append(f"markov_rank={cfg.markov_rank}: a dflash draft has no Markov head "
                        "(set 0)")
    if cfg.enable_confidence_head or cfg.confidence_head_with_markov:
        problems.append("enable_confidence_head / confidence_head_with_markov: a dflash draft "
                        "has no confidence head (set both false)")
    if cfg.block_size < 2:
        problems.append(f"block_size={cfg.block_size}: a dflash block drafts block_size - 1 "
                        "tokens, so it needs block_size >= 2")
    return problems


def _deepseek_v4_problems(cfg: DSparkDraftConfig) -> list[str]:
    problems = [f"{name}={getattr(cfg, name)} must be > 0 for architecture='deepseek_v4'"
                for name in ("q_lora_rank", "o_lora_rank", "o_groups", "qk_rope_head_dim")
                if getattr(cfg, name) <= 0]
    if cfg.num_key_value_heads != 1:
        problems.append(f"num_key_value_heads={cfg.num_key_value_heads}: a deepseek_v4 draft has "
                        "one key/value latent shared by every head (1)")
    if cfg.o_groups > 0 and cfg.num_attention_heads % cfg.o_groups:
        problems.append(f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
                        f"o_groups={cfg.o_groups}")
    if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim > cfg.head_dim:
        problems.append(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even and at most "
                        f"head_dim={cfg.head_dim}")
    return problems


def _kimi_k3_problems(cfg: DSparkDraftConfig) -> list[str]:
    problems = [f"{name}={getattr(cfg, name)} must be > 0 for architecture='kimi_k3'"
                for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                if getattr(cfg, name) <= 0]
    if cfg.q_lora_rank <= 0:
        problems.append(f"q_lora_rank={cfg.q_lora_rank}: vLLM's K3DSparkForCausalLM needs a "
                        "query low-rank bottleneck (q_lora_rank > 0); a target without one "
                        "(Kimi-Linear) needs it set, e.g. model.draft.overrides.q_lora_rank")
    if cfg.qk_rope_head_dim % 2:
        problems.append(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even for RoPE")
    if cfg.head_dim != cfg.qk_nope_head_dim + cfg.qk_rope_head_dim:
        problems.append(f"head_dim={cfg.head_dim} must be qk_nope_head_dim + qk_rope_head_dim="
                        f"{cfg.qk_nope_head_dim + cfg.qk_rope_head_dim} (the query/key head)")
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        problems.append(f"num_key_value_heads={cfg.num_key_value_heads}: MLA expands the latent "
                        f"into one key/value per head ({cfg.num_attention_heads})")
    return problems


_ARCHITECTURE_FIELDS: dict[str, tuple[str, ...]] = {
    "deepseek_v4": ("q_lora_rank", "o_lora_rank", "o_groups", "qk_rope_head_dim",
                    "swiglu_limit"),
    "kimi_k3": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim"),
}
"""The config fields only some architectures read; every other one must leave them unset."""
_FIELD_READERS = {name: tuple(a for a, own in _ARCHITECTURE_FIELDS.items() if name in own)
                  for name in dict.fromkeys(n for f in _ARCHITECTURE_FIELDS.values() for n in f)}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DSparkDraftConfig)}
# The DeepSeek-V4 target config field each deepseek_v4 draft field is copied from; the draft's
# MLP is one dense SwiGLU as wide as the target's experts.
_V4_TARGET_FIELDS = {"q_lora_rank": "q_lora_rank", "o_lora_rank": "o_lora_rank",
                     "o_groups": "o_groups", "qk_rope_head_dim": "qk_rope_head_dim",
                     "intermediate_size": "moe_intermediate_size"}


def _deepseek_v4_fields(tc: Any, model_type: str) -> dict[str, Any]:
    """The sizes a deepseek_v4 draft copies from its DeepSeek-V4 target's text config.

    The draft keeps the target's attention (Q-LoRA, one K=V latent, grouped O-LoRA, partial
    RoPE, sinks) and drops what a dense draft has no use for: compressed/sparse attention,
    hash routing, experts and MTP layers.
    """
    missing = sorted(t for t in _V4_TARGET_FIELDS.values() if getattr(tc, t, None) is None)
    if missing:
        raise ValueError(f"architecture='deepseek_v4' needs a DeepSeek-V4 target: the "
                         f"{model_type!r} target config has no {missing}")
    out: dict[str, Any] = {d: int(getattr(tc, t)) for d, t in _V4_TARGET_FIELDS.items()}
    limit = getattr(tc, "swiglu_limit", None)
    out["swiglu_limit"] = None if limit is None else float(limit)
    out["num_key_value_heads"] = 1
    return out


# The Kimi target config field each kimi_k3 draft field is copied from (MLA sizes; a target
# without a query bottleneck, like Kimi-Linear, has q_lora_rank None and the run must set it).
_K3_TARGET_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim")


def _kimi_k3_fields(tc: Any, model_type: str) -> dict[str, Any]:
    """The MLA sizes a kimi_k3 draft copies from its Kimi target's text config.

    The draft's query/key head is ``qk_nope_head_dim + qk_rope_head_dim`` wide and every head
    has its own key and value (expanded from the shared latent), so ``head_dim`` and
    ``num_key_value_heads`` follow from them.
    """
    missing = sorted(t for t in _K3_TARGET_FIELDS[1:] if getattr(tc, t, None) is None)
    if missing:
        raise ValueError(f"architecture='kimi_k3' needs an MLA target: the {model_type!r} "
                         f"target config has no {missing}")
    out: dict[str, Any] = {t: int(getattr(tc, t) or 0) for t in _K3_TARGET_FIELDS}
    out["head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    out["num_key_value_heads"] = int(tc.num_attention_heads)
    return out


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


def from_target_config(
    target_config: Any,
    *,
    mask_token_id: int,
    target_layer_ids: Sequence[int] | None = None,
    **overrides: Any,
) -> DSparkDraftConfig:
    """Derive a draft config from a target HF config (nested ``text_config`` handled).

    Attention sizes and RoPE are those of the target's full-attention layers (Gemma4 sizes them
    per layer; see ``TargetConfig.attention``). Gemma targets give the sqrt(H) embedding scale
    and their final logit softcap.

    Args:
        target_config: A transformers ``PretrainedConfig`` of the target (or any object whose
            attributes are its ``config.json`` fields).
        mask_token_id: Required; never defaulted to the pad id.
        target_layer_ids: Feature ids; default = DFlash rule for the draft depth.
        **overrides: Any DSpark field (num_hidden_layers, block_size, markov_rank, ...).
    """
    tc = text_config(target_config)
    # Per-layer and derived facts (Gemma4's full-attention sizes and RoPE, the embedding scale,
    # the softcap) are read from the config's JSON form by the one target-config reader; plain
    # sizes from the config object, whose properties also derive sizes its JSON leaves null.
    target = TargetConfig(raw=_as_mapping(target_config), source="target config")
    attention = target.attention
    model_type = str(getattr(tc, "model_type", "") or getattr(target_config, "model_type", ""))
    family = family_of(model_type)
    heads = int(tc.num_attention_heads)
    depth = int(overrides.get("num_hidden_layers", 5))
    rope = attention.get("rope_parameters") or {
        "rope_type": "default", "rope_theta": float(getattr(tc, "rope_theta", 10_000.0))
    }
    if family.rope_section is not None:
        # Per-layer-type RoPE (DeepSeek-V4): the draft's full RoPE uses the main section's base.
        section = rope[family.rope_section]
        rope = {"rope_type": section.get("rope_type", "default"),
                "rope_theta": float(section["rope_theta"])}
    base: dict[str, Any] = {
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
    }
    if overrides.get("architecture") == "deepseek_v4":
        base |= _deepseek_v4_fields(tc, model_type)
    if overrides.get("architecture") == "kimi_k3":
        base |= _kimi_k3_fields(tc, model_type)
    ids = target_layer_ids
    if ids is None:
        ids = default_feature_ids(base["num_target_layers"], depth)
    return DSparkDraftConfig(
        **{**base, **overrides}, mask_token_id=mask_token_id, target_layer_ids=tuple(ids)
    )


def draft_tiny(*, vocab_size: int = 256, mask_token_id: int = 3) -> DSparkDraftConfig:
    """A CPU-test draft: H=64, 1 layer, head_dim 16, K=4, 8 anchors, r=16."""
    return DSparkDraftConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=vocab_size, num_hidden_layers=1,
        num_target_layers=4, target_layer_ids=(0, 1, 2), block_size=4, num_anchors=8,
        markov_rank=16, mask_token_id=mask_token_id, rope_parameters={
            "rope_type": "default", "rope_theta": 10_000.0},
    )


def draft_tiny_deepseek_v4(*, vocab_size: int = 256, mask_token_id: int = 3) -> DSparkDraftConfig:
    """draft_tiny() as a deepseek_v4 draft: one K=V latent, Q-LoRA 32, 2 output groups, RoPE 8."""
    return dataclasses.replace(
        draft_tiny(vocab_size=vocab_size, mask_token_id=mask_token_id),
        architecture="deepseek_v4", num_key_value_heads=1, q_lora_rank=32, o_lora_rank=16,
        o_groups=2, qk_rope_head_dim=8, swiglu_limit=10.0)


def draft_tiny_kimi_k3(*, vocab_size: int = 256, mask_token_id: int = 3) -> DSparkDraftConfig:
    """draft_tiny() as a kimi_k3 draft: Q-LoRA 32, latent 16, heads 16 nope + 8 rope, values 16."""
    return dataclasses.replace(
        draft_tiny(vocab_size=vocab_size, mask_token_id=mask_token_id),
        architecture="kimi_k3", num_key_value_heads=4, head_dim=24, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def draft_qwen3_small(*, mask_token_id: int = 151_669) -> DSparkDraftConfig:
    """A Qwen3-0.6B-shaped draft (H=1024, 2 layers, V=151_936), used by the CPU benchmark."""
    return DSparkDraftConfig(
        hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151_936, num_hidden_layers=2, num_target_layers=28,
        target_layer_ids=(1, 7, 14, 21, 26), block_size=7, num_anchors=512, markov_rank=256,
        mask_token_id=mask_token_id,
    )


def backbone_config(cfg: DSparkDraftConfig) -> dict[str, Any]:
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


def dspark_fields(cfg: DSparkDraftConfig) -> dict[str, Any]:
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


def serving_config(cfg: DSparkDraftConfig) -> dict[str, Any]:
    """config.json fields vLLM/SGLang read for a Qwen3-shaped DSpark draft."""
    return {**backbone_config(cfg), "architectures": ["Qwen3DSparkModel"], **dspark_fields(cfg)}
