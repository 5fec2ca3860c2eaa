"""The deepseek_v4 draft's own config fields, their checks and their derivation from a target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkforge.shared.errors import ConfigError
from sparkforge.trainer.architectures.low_rank_query import LowRankQueryFields

if TYPE_CHECKING:
    from sparkforge.trainer.architectures.config import DraftConfig


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Fields(LowRankQueryFields):
    """The DeepSeek-V4 attention sizes a deepseek_v4 draft reads (copied from its target)."""

    o_lora_rank: int = 0
    """Low-rank width of each head group's output projection (wo_a)."""
    o_groups: int = 0
    """Head groups of the grouped output projection."""
    swiglu_limit: float | None = None
    """SwiGLU clamp (gate <= limit, -limit <= up <= limit); None: no clamp."""


def problems(cfg: DraftConfig) -> list[str]:
    """Why the config's V4 attention sizes do not fit together (empty when they do)."""
    out = [f"{name}={getattr(cfg, name)} must be > 0 for architecture='deepseek_v4'"
           for name in ("q_lora_rank", "o_lora_rank", "o_groups", "qk_rope_head_dim")
           if getattr(cfg, name) <= 0]
    if cfg.num_key_value_heads != 1:
        out.append(f"num_key_value_heads={cfg.num_key_value_heads}: a deepseek_v4 draft has "
                   "one key/value latent shared by every head (1)")
    if cfg.o_groups > 0 and cfg.num_attention_heads % cfg.o_groups:
        out.append(f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
                   f"o_groups={cfg.o_groups}")
    if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim > cfg.head_dim:
        out.append(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even and at most "
                   f"head_dim={cfg.head_dim}")
    return out


# The DeepSeek-V4 target config field each deepseek_v4 draft field is copied from; the draft's
# MLP is one dense SwiGLU as wide as the target's experts.
_V4_TARGET_FIELDS = {"q_lora_rank": "q_lora_rank", "o_lora_rank": "o_lora_rank",
                     "o_groups": "o_groups", "qk_rope_head_dim": "qk_rope_head_dim",
                     "intermediate_size": "moe_intermediate_size"}


def target_fields(tc: Any, model_type: str) -> dict[str, Any]:
    """The sizes a deepseek_v4 draft copies from its DeepSeek-V4 target's text config.

    The draft keeps the target's attention (Q-LoRA, one K=V latent, grouped O-LoRA, partial
    RoPE, sinks) and drops what a dense draft has no use for: compressed/sparse attention,
    hash routing, experts and MTP layers.
    """
    missing = sorted(t for t in _V4_TARGET_FIELDS.values() if getattr(tc, t, None) is None)
    if missing:
        raise ConfigError(f"architecture='deepseek_v4' needs a DeepSeek-V4 target: the "
                         f"{model_type!r} target config has no {missing}")
    out: dict[str, Any] = {d: int(getattr(tc, t)) for d, t in _V4_TARGET_FIELDS.items()}
    limit = getattr(tc, "swiglu_limit", None)
    out["swiglu_limit"] = None if limit is None else float(limit)
    out["num_key_value_heads"] = 1
    return out
