"""The kimi_k3 draft's own config fields (MLA sizes), their checks and their derivation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkforge.shared.errors import ConfigError
from sparkforge.trainer.architectures.low_rank_query import LowRankQueryFields

if TYPE_CHECKING:
    from sparkforge.trainer.architectures.config import DraftConfig


@dataclass(frozen=True, kw_only=True)
class KimiK3Fields(LowRankQueryFields):
    """The MLA sizes a kimi_k3 draft reads (copied from its Kimi target)."""

    kv_lora_rank: int = 0
    """Width of the key/value latent (kv_a_proj_with_mqa -> kv_a_layernorm)."""
    qk_nope_head_dim: int = 0
    """Leading channels of each query/key head that RoPE leaves alone."""
    v_head_dim: int = 0
    """Per-head value size (kv_b_proj makes nope keys and values from the latent)."""


# The Kimi target config fields the draft copies, each into its namesake.
_K3_TARGET_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim")


def problems(cfg: DraftConfig) -> list[str]:
    """Why the config's MLA sizes do not fit together or vLLM cannot build them."""
    out = [f"{name}={getattr(cfg, name)} must be > 0 for architecture='kimi_k3'"
           for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
           if getattr(cfg, name) <= 0]
    if cfg.q_lora_rank <= 0:
        out.append(f"q_lora_rank={cfg.q_lora_rank}: vLLM's K3DSparkForCausalLM needs a "
                   "query low-rank bottleneck (q_lora_rank > 0); a target without one "
                   "(Kimi-Linear) needs it set, e.g. model.draft.overrides.q_lora_rank")
    if cfg.qk_rope_head_dim % 2:
        out.append(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even for RoPE")
    if cfg.head_dim != cfg.qk_nope_head_dim + cfg.qk_rope_head_dim:
        out.append(f"head_dim={cfg.head_dim} must be qk_nope_head_dim + qk_rope_head_dim="
                   f"{cfg.qk_nope_head_dim + cfg.qk_rope_head_dim} (the query/key head)")
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        out.append(f"num_key_value_heads={cfg.num_key_value_heads}: MLA expands the latent "
                   f"into one key/value per head ({cfg.num_attention_heads})")
    return out


def target_fields(tc: Any, model_type: str) -> dict[str, Any]:
    """The MLA sizes a kimi_k3 draft copies from its Kimi target's text config.

    The draft's query/key head is ``qk_nope_head_dim + qk_rope_head_dim`` wide and every head
    has its own key and value (expanded from the shared latent), so ``head_dim`` and
    ``num_key_value_heads`` follow from them. A target without a query bottleneck (Kimi-Linear)
    has q_lora_rank None and the run must set it.
    """
    missing = sorted(t for t in _K3_TARGET_FIELDS[1:] if getattr(tc, t, None) is None)
    if missing:
        raise ConfigError(f"architecture='kimi_k3' needs an MLA target: the {model_type!r} "
                         f"target config has no {missing}")
    out: dict[str, Any] = {t: int(getattr(tc, t) or 0) for t in _K3_TARGET_FIELDS}
    out["head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    out["num_key_value_heads"] = int(tc.num_attention_heads)
    return out
