"""Qwen3-style draft layers: RMSNorm, SwiGLU MLP, KV-injected non-causal attention, the layer.

Shape suffixes follow the legend in ``sparkforge.trainer.model``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from sparkforge.trainer.draft_config import DSparkDraftConfig
from sparkforge.trainer.rope import apply_rotary


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale by a learned weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last axis."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


@functools.cache
def compiled_flex() -> Any:
    """flex_attention compiled once per process (its fused kernel on CUDA)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
    """SDPA over a dense bool mask (or none), flex attention over a BlockMask; GQA either way.

    Flex is compiled on CUDA (its fused kernel); on CPU it runs eagerly, forward only.
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if isinstance(mask, BlockMask):
        fn = compiled_flex() if q.is_cuda else flex_attention
        out: torch.Tensor = fn(q, k, v, block_mask=mask, enable_gqa=True)
        return out
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class DSparkAttention(nn.Module):
    """Queries from the block only; keys/values = [projected context ; block], same weights."""

    def __init__(self, cfg: DSparkDraftConfig) -> None:
        super().__init__()
        n, g, d, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.num_heads, self.num_kv, self.head_dim = n, g, d
        self.q_proj = nn.Linear(h, n * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, g * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, g * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(n * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def key_values(
        self, x_BPH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k_norm'ed, rotated keys and values [B, G, P, D] for the rows of ``x``."""
        b, p, _ = x_BPH.shape
        k = self.k_norm(self.k_proj(x_BPH).view(b, p, self.num_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BPH).view(b, p, self.num_kv, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(
        self,
        x_BQH: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        ctx_kv: tuple[torch.Tensor, torch.Tensor],
        mask: Any,
    ) -> torch.Tensor:
        """Attend block queries over ``[ctx ; block]`` keys under ``mask`` (None = all visible)."""
        b, nq, _ = x_BQH.shape
        q = self.q_norm(self.q_proj(x_BQH).view(b, nq, self.num_heads, self.head_dim))
        q = apply_rotary(q.transpose(1, 2), *rope_q)
        k_blk, v_blk = self.key_values(x_BQH, *rope_q)
        k = torch.cat([ctx_kv[0].to(k_blk.dtype), k_blk], dim=2)
        v = torch.cat([ctx_kv[1].to(v_blk.dtype), v_blk], dim=2)
        out = _attend(q, k, v, mask)
        res: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, nq, -1))
        return res


class DSparkLayer(nn.Module):
    """Pre-norm block: input_layernorm -> attention -> +res -> post_attention_layernorm -> MLP."""

    def __init__(self, cfg: DSparkDraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSparkAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def key_values(
        self, x_BPH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's keys and values [B, G, P, D] for context rows ``x``."""
        return self.self_attn.key_values(x_BPH, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        ctx_kv: tuple[torch.Tensor, torch.Tensor],
        mask: Any,
    ) -> torch.Tensor:
        """One residual layer over the block stream."""
        x = x + self.self_attn(self.input_layernorm(x), rope_q, ctx_kv, mask)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out
