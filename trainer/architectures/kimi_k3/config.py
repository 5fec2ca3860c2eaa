"""The kimi_k3 draft's options (its MLA sizes), their checks and their derivation."""

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
class KimiK3Options(LowRankQueryFields):
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


def k3_options(cfg: SharedDraftConfig) -> KimiK3Options:
    """The kimi_k3 draft's options (``cfg.options``, typed)."""
    return options_of(cfg, KimiK3Options)


def problems(cfg: DraftConfig) -> list[str]:
    """Why the config's MLA sizes do not fit together or vLLM cannot build them."""
    opts = k3_options(cfg)
    out = [f"options.{name}={getattr(opts, name)} must be > 0 for architecture='kimi_k3'"
           for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
           if getattr(opts, name) <= 0]
    if opts.q_lora_rank <= 0:
        out.append(f"options.q_lora_rank={opts.q_lora_rank}: vLLM's K3DSparkForCausalLM needs "
                   "a query low-rank bottleneck (q_lora_rank > 0); a target without one "
                   "(Kimi-Linear) needs it set, e.g. model.draft.options.q_lora_rank")
    if opts.qk_rope_head_dim % 2:
        out.append(f"options.qk_rope_head_dim={opts.qk_rope_head_dim} must be even for RoPE")
    qk_head = opts.qk_nope_head_dim + opts.qk_rope_head_dim
    if cfg.head_dim != qk_head:
        out.append(f"head_dim={cfg.head_dim} must be qk_nope_head_dim + qk_rope_head_dim="
                   f"{qk_head} (the query/key head)")
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        out.append(f"num_key_value_heads={cfg.num_key_value_heads}: MLA expands the latent "
                   f"into one key/value per head ({cfg.num_attention_heads})")
    return out


def target_fields(tc: Any, model_type: str) -> dict[str, Any]:
    """The MLA sizes a kimi_k3 draft copies from its Kimi target's text config: its
    ``options`` and the generic fields they fix.

    The draft's query/key head is ``qk_nope_head_dim + qk_rope_head_dim`` wide and every head
    has its own key and value (expanded from the shared latent), so ``head_dim`` and
    ``num_key_value_heads`` follow from them. A target without a query bottleneck (Kimi-Linear)
    has q_lora_rank None and the run must set it.
    """
    missing = sorted(t for t in _K3_TARGET_FIELDS[1:] if getattr(tc, t, None) is None)
    if missing:
        raise ConfigError(f"architecture='kimi_k3' needs an MLA target: the {model_type!r} "
                         f"target config has no {missing}")
    options = {t: int(getattr(tc, t) or 0) for t in _K3_TARGET_FIELDS}
    return {"options": options,
            "head_dim": options["qk_nope_head_dim"] + options["qk_rope_head_dim"],
            "num_key_value_heads": int(tc.num_attention_heads)}


RENAMED = {"KimiK3Fields": "KimiK3Options"}
"""Old names this module still serves, each as its new name (``renamed_attribute``)."""


def __getattr__(name: str) -> Any:
    """An old name of ``RENAMED``, with a FutureWarning naming its replacement."""
    return renamed_attribute(__name__, name, RENAMED)
