"""Qwen3-style draft layers: RMSNorm, gated MLP, KV-injected non-causal attention, the layer.

Shape suffixes follow the legend in ``sparkforge.trainer.draft.model``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from sparkforge.shared.renamed import renamed_attribute
from sparkforge.trainer.draft.block_conv import around, block_convs
from sparkforge.trainer.draft.config import SharedDraftConfig
from sparkforge.trainer.draft.passes import DraftLayer
from sparkforge.trainer.draft.rope import apply_rotary


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in fp32, cast back, then scale by a learned weight (or by
    nothing) in the input's dtype."""

    def __init__(self, dim: int, eps: float, *, with_weight: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if with_weight else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last axis."""
        x32 = x.float()
        out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return out if self.weight is None else self.weight * out


class GemmaRMSNorm(RMSNorm):
    """Gemma4's RMSNorm (transformers' and vLLM's order): normalise and scale by the weight, both
    in fp32, then cast back; in bf16 this rounds once where Qwen3's order rounds twice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last axis."""
        x32 = x.float()
        out = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (HF ``gelu_pytorch_tanh``, Gemma's activation)."""
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """Gated feed-forward: SwiGLU (Qwen3) by default, GeGLU with ``act=gelu_tanh`` (Gemma)."""

    def __init__(self, hidden: int, inter: int,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x))."""
        out: torch.Tensor = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return out


@functools.cache
def compiled_flex() -> Any:
    """flex_attention compiled once per process (its fused kernel on CUDA)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
            scale: float | None = None) -> torch.Tensor:
    """SDPA over a dense bool mask (or none), flex attention over a BlockMask; GQA either way.

    ``scale`` multiplies the q.k logits (None: 1/sqrt(D)). Flex is compiled on CUDA (its fused
    kernel); on CPU it runs eagerly, forward only.
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if isinstance(mask, BlockMask):
        fn = compiled_flex() if q.is_cuda else flex_attention
        out: torch.Tensor = fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
        return out
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


class DraftAttention(nn.Module):
    """Queries from the block only; keys/values = [projected context ; block], same weights.

    Args:
        cfg: The draft config (sizes).
        k_eq_v: Gemma4's ``attention_k_eq_v``: no ``v_proj``; the values are the raw key
            projection normalised by a weightless RMSNorm (``v_norm``), without RoPE.
        softmax_scale: Multiplier on the q.k logits (None: 1/sqrt(head_dim); Gemma4: 1.0).
        norm: The q/k/v norms' class (Gemma4: ``GemmaRMSNorm``).
    """

    def __init__(self, cfg: SharedDraftConfig, *, k_eq_v: bool = False,
                 softmax_scale: float | None = None, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        n, g, d, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.num_heads, self.num_kv, self.head_dim = n, g, d
        self.softmax_scale = softmax_scale
        self.q_proj = nn.Linear(h, n * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, g * d, bias=cfg.attention_bias)
        self.v_proj = None if k_eq_v else nn.Linear(h, g * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(n * d, h, bias=cfg.attention_bias)
        self.q_norm = norm(d, cfg.rms_norm_eps)
        self.k_norm = norm(d, cfg.rms_norm_eps)
        self.v_norm = norm(d, cfg.rms_norm_eps, with_weight=False) if k_eq_v else None

    def key_values(
        self, x_BPH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k_norm'ed, rotated keys and values [B, G, P, D] for the rows of ``x``."""
        b, p, _ = x_BPH.shape
        k_BPGD = self.k_proj(x_BPH).view(b, p, self.num_kv, self.head_dim)
        if self.v_proj is None:
            assert self.v_norm is not None
            v_BPGD = self.v_norm(k_BPGD)
        else:
            v_BPGD = self.v_proj(x_BPH).view(b, p, self.num_kv, self.head_dim)
        k = apply_rotary(self.k_norm(k_BPGD).transpose(1, 2), cos, sin)
        return k, v_BPGD.transpose(1, 2)

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
        return attend_after_context(q, k_blk, v_blk, ctx_kv, mask, self.softmax_scale,
                                    self.o_proj)


def attend_after_context(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor,
                         ctx_kv: tuple[torch.Tensor, torch.Tensor], mask: Any, scale: float | None,
                         o_proj: nn.Module) -> torch.Tensor:
    """Block queries [B, N, Q, D] over ``[ctx ; block]`` keys and values, then ``o_proj``."""
    b, _, nq, _ = q.shape
    k = torch.cat([ctx_kv[0].to(k_blk.dtype), k_blk], dim=2)
    v = torch.cat([ctx_kv[1].to(v_blk.dtype), v_blk], dim=2)
    out = attend(q, k, v, mask, scale)
    res: torch.Tensor = o_proj(out.transpose(1, 2).reshape(b, nq, -1))
    return res


class DraftDecoderLayer(nn.Module):
    """Pre-norm block: input_layernorm -> attention -> +res -> post_attention_layernorm -> MLP.

    With ``sandwich`` (Gemma's layer) the attention and MLP outputs are normed before their
    residual adds: input_layernorm -> attention -> post_attention_layernorm -> +res ->
    pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm -> +res. A DFlash2 layout
    wraps the attention and the MLP in their block convolutions (``attention_conv``,
    ``mlp_conv``; ``sparkforge.trainer.draft.block_conv``), inside the norms.

    Args:
        cfg: The draft config (sizes).
        attention: Builds the layer's attention from the config (default: Qwen3's), a
            ``DraftLayer`` as far as calls go (``key_values`` and the same call signature).
        norm: The layer norms' class (Gemma4: ``GemmaRMSNorm``).
        act: The MLP's gate activation (default SiLU; Gemma4: ``gelu_tanh``).
        sandwich: Norm the attention and MLP outputs too (Gemma's sandwich norms).
    """

    pre_feedforward_layernorm: nn.Module
    post_feedforward_layernorm: nn.Module

    def __init__(self, cfg: SharedDraftConfig,
                 attention: Callable[..., nn.Module] = DraftAttention, *,
                 norm: type[RMSNorm] = RMSNorm,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
                 sandwich: bool = False) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.sandwich = sandwich
        self.input_layernorm = norm(h, eps)
        self.self_attn = attention(cfg)
        self.post_attention_layernorm = norm(h, eps)
        if sandwich:
            self.pre_feedforward_layernorm = norm(h, eps)
        self.mlp = MLP(h, cfg.intermediate_size, act=act)
        if sandwich:
            self.post_feedforward_layernorm = norm(h, eps)
        self.attention_conv, self.mlp_conv = block_convs(cfg)

    def key_values(
        self, x_BPH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's keys and values [B, G, P, D] for context rows ``x``."""
        return cast(DraftLayer, self.self_attn).key_values(x_BPH, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        ctx_kv: tuple[torch.Tensor, torch.Tensor],
        mask: Any,
    ) -> torch.Tensor:
        """One residual layer over the block stream."""
        attn = around(self.attention_conv, lambda h: self.self_attn(h, rope_q, ctx_kv, mask),
                      self.input_layernorm(x))
        if not self.sandwich:
            x = x + attn
            out: torch.Tensor = x + around(self.mlp_conv, self.mlp,
                                           self.post_attention_layernorm(x))
            return out
        x = x + self.post_attention_layernorm(attn)
        mlp = around(self.mlp_conv, self.mlp, self.pre_feedforward_layernorm(x))
        out = x + self.post_feedforward_layernorm(mlp)
        return out


RENAMED = {"DSparkAttention": "DraftAttention", "DSparkLayer": "DraftDecoderLayer"}
"""Old names this module still serves, each as its new name (``renamed_attribute``)."""


def __getattr__(name: str) -> Any:
    """An old name of ``RENAMED``, with a FutureWarning naming its replacement."""
    return renamed_attribute(__name__, name, RENAMED)
