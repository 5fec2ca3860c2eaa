"""Rotary position embedding whose inverse frequencies stay fp32 through any dtype cast."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn


def compute_inv_freq(
    head_dim: int, rope_parameters: Mapping[str, Any], max_position_embeddings: int,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, float]:
    """fp32 inverse frequencies and the attention scaling for the target's RoPE settings.

    "default" is computed here; scaled types (linear, yarn, llama3, ...) go through
    transformers' own RoPE initialisers so the draft matches the target exactly. A
    ``partial_rotary_factor`` p < 1 gives frequencies for the leading ``int(head_dim * p)``
    channels only (as vLLM's ``get_rope`` and transformers' partial-rotary models rotate).
    """
    rope_type = rope_parameters.get("rope_type", "default")
    theta = float(rope_parameters.get("rope_theta", 10_000.0))
    if rope_type == "default":
        dim = int(head_dim * float(rope_parameters.get("partial_rotary_factor", 1.0)))
        exps = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        return 1.0 / (theta ** exps), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = Qwen3Config(head_dim=head_dim, hidden_size=head_dim, num_attention_heads=1,
                     rope_parameters=dict(rope_parameters),
                     max_position_embeddings=max_position_embeddings)
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, device)
    return inv.float(), float(scale)


_SERVED_OTHERWISE = {
    "dynamic": "vLLM rotates every position with one NTK table scaled for "
               "max_position_embeddings x factor, transformers (which the draft trains and the HF "
               "backend captures with) only past max_position_embeddings",
    "longrope": "vLLM picks the short or the long factors from the serving max_model_len, the "
                "draft trains with the short ones",
}
"""The RoPE types transformers builds (so a draft trains with them) that vLLM serves with
another table; the others (default, linear, yarn, llama3, proportional) vLLM builds as the
draft trains (``tests/integration/test_rope_vllm.py`` compares vLLM's tables with the draft's)."""


def served_rope_problems(rope_parameters: Mapping[str, Any]) -> list[str]:
    """Why a served draft would not rotate as it trained (empty when it would)."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in _SERVED_OTHERWISE:
        return []
    return [f"rope_parameters.rope_type={rope_type!r}: the served draft would not rotate as it "
            f"trained: {_SERVED_OTHERWISE[rope_type]}"]


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary positions; ``inv_freq`` is rebuilt in fp32 after casts.

    Rounding ``inv_freq`` to bf16 puts the frequencies out of phase with absolute position
    (servers keep RoPE fp32), so an up-cast of the rounded buffer is not enough: the
    ``_apply`` override recomputes it from the settings.

    Args:
        head_dim: The rotated width (DeepSeek-V4: its ``qk_rope_head_dim`` slice).
        rope_parameters: HF-5 style settings (rope_type, rope_theta, scaling keys).
        max_position_embeddings: Longest position the settings are meant for.
        interleaved: Tables for pairs of adjacent channels (DeepSeek-V4, see
            ``apply_interleaved_rotary``) instead of Qwen3's two halves.
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, rope_parameters: Mapping[str, Any],
                 max_position_embeddings: int, *, interleaved: bool = False) -> None:
        super().__init__()
        self.interleaved = interleaved
        self._settings = (head_dim, dict(rope_parameters), max_position_embeddings)
        inv, self.attention_scaling = compute_inv_freq(*self._settings)
        self.register_buffer("inv_freq", inv, persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        out = super()._apply(fn, recurse)
        inv = self.inv_freq
        if inv.dtype != torch.float32:
            self.inv_freq = compute_inv_freq(*self._settings, device=inv.device)[0]
        return out

    def forward(self, positions_BP: torch.Tensor, dtype: torch.dtype) -> tuple[
            torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, P, D] in ``dtype``, computed in fp32."""
        freqs = positions_BP[..., None].float() * self.inv_freq.float()
        emb = (freqs.repeat_interleave(2, dim=-1) if self.interleaved
               else torch.cat([freqs, freqs], dim=-1))[:, None]
        scale = self.attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of ``x [B, N, P, D]`` (Qwen3's rotate_half) over its leading
    ``R = cos.shape[-1]`` channels; the other ``D - R`` pass unchanged (partial rotary)."""
    rope_dim = cos.shape[-1]
    if rope_dim < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rope_dim], cos, sin), x[..., rope_dim:]], dim=-1)
    half = rope_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4 RoPE: rotate adjacent channel pairs of the trailing ``R`` channels of ``x``.

    ``x [B, N, P, D]``; ``cos``/``sin [B, 1, P, R]`` from an ``interleaved`` table (R <= D). The
    leading ``D - R`` channels pass unchanged; the rotation runs in fp32. Passing ``-sin``
    undoes a rotation at the same positions (V4's output inverse RoPE).
    """
    rope_dim = cos.shape[-1]
    nope, rope = x[..., : x.shape[-1] - rope_dim], x[..., x.shape[-1] - rope_dim:].float()
    pairs = rope.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    out = rope * cos.float() + rotated * sin.float()
    return torch.cat([nope, out.to(x.dtype)], dim=-1)
