"""Options that two architectures read alike: deepseek_v4 and kimi_k3 (MLA-style queries)."""

from __future__ import annotations

from dataclasses import dataclass

from sparkforge.trainer.architectures.options import ArchitectureOptions


@dataclass(frozen=True, kw_only=True)
class LowRankQueryFields(ArchitectureOptions):
    """A low-rank query bottleneck and a partial RoPE (sizes copied from the target)."""

    q_lora_rank: int = 0
    """Width of the query low-rank bottleneck (deepseek_v4: wq_a -> q_norm -> wq_b; kimi_k3:
    q_a_proj -> q_a_layernorm -> q_b_proj)."""
    qk_rope_head_dim: int = 0
    """Channels of each head that RoPE rotates, in adjacent pairs (deepseek_v4: the trailing
    ones of each head; kimi_k3: the key's rope part, shared by every head)."""
