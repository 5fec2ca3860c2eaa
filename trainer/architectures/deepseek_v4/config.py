"""The deepseek_v4 draft's options (its own config fields), their checks and their derivation
from a target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkforge.shared.errors import ConfigError
from sparkforge.shared.renamed import renamed_attribute
from sparkforge.trainer.architectures.low_rank_query import LowRankQueryFields
from sparkforge.trainer.architectures.options import options_of

if TYPE_CHECKING:
    from sparkforge.trainer.architectures.config import DraftConfig
    from sparkforge.trainer.draft.config import SharedDraftConfig


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Options(LowRankQueryFields):
    """The DeepSeek-V4 attention sizes a deepseek_v4 draft reads (copied from its target)."""

    o_lora_rank: int = 0
    """Low-rank width of each head group's output projection (wo_a)."""
    o_groups: int = 0
    """Head groups of the grouped output projection."""
    swiglu_limit: float | None = None
    """SwiGLU clamp (gate <= limit, -limit <= up <= limit); None: no clamp."""


def v4_options(cfg: SharedDraftConfig) -> DeepseekV4Options:
    """The deepseek_v4 draft's options (``cfg.options``, typed)."""
    return options_of(cfg, DeepseekV4Options)


def problems(cfg: DraftConfig) -> list[str]:
    """Why the config's V4 attention sizes do not fit together (empty when they do)."""
    opts = v4_options(cfg)
    out = [f"options.{name}={getattr(opts, name)} must be > 0 for architecture='deepseek_v4'"
           for name in ("q_lora_rank", "o_lora_rank", "o_groups", "qk_rope_head_dim")
           if getattr(opts, name) <= 0]
    if cfg.num_key_value_heads != 1:
        out.append(f"num_key_value_heads={cfg.num_key_value_heads}: a deepseek_v4 draft has "
                   "one key/value latent shared by every head (1)")
    if opts.o_groups > 0 and cfg.num_attention_heads % opts.o_groups:
        out.append(f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
                   f"options.o_groups={opts.o_groups}")
    if opts.qk_rope_head_dim % 2 or opts.qk_rope_head_dim > cfg.head_dim:
        out.append(f"options.qk_rope_head_dim={opts.qk_rope_head_dim} must be even and at most "
                   f"head_dim={cfg.head_dim}")
    return out


# The DeepSeek-V4 target config field each deepseek_v4 draft option is copied from.
_V4_TARGET_OPTIONS = ("q_lora_rank", "o_lora_rank", "o_groups", "qk_rope_head_dim")
# The draft's MLP is one dense SwiGLU as wide as the target's experts.
_V4_WIDTH = "moe_intermediate_size"


def target_fields(tc: Any, model_type: str) -> dict[str, Any]:
    """The sizes a deepseek_v4 draft copies from its DeepSeek-V4 target's text config: its
    ``options`` and the generic fields they fix.

    The draft keeps the target's attention (Q-LoRA, one K=V latent, grouped O-LoRA, partial
    RoPE, sinks) and drops what a dense draft has no use for: compressed/sparse attention,
    hash routing, experts and MTP layers.
    """
    missing = sorted(t for t in (*_V4_TARGET_OPTIONS, _V4_WIDTH) if getattr(tc, t, None) is None)
    if missing:
        raise ConfigError(f"architecture='deepseek_v4' needs a DeepSeek-V4 target: the "
                         f"{model_type!r} target config has no {missing}")
    options: dict[str, Any] = {t: int(getattr(tc, t)) for t in _V4_TARGET_OPTIONS}
    limit = getattr(tc, "swiglu_limit", None)
    options["swiglu_limit"] = None if limit is None else float(limit)
    return {"options": options, "intermediate_size": int(getattr(tc, _V4_WIDTH)),
            "num_key_value_heads": 1}


RENAMED = {"DeepseekV4Fields": "DeepseekV4Options"}
"""Old names this module still serves, each as its new name (``renamed_attribute``)."""


def __getattr__(name: str) -> Any:
    """An old name of ``RENAMED``, with a FutureWarning naming its replacement."""
    return renamed_attribute(__name__, name, RENAMED)
