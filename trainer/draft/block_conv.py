"""DFlash2's block convolution: a token-dependent causal convolution along each draft block.

A layer of a DFlash2 draft wraps its attention and its MLP (each a *sublayer*) in one
``BlockConv``: ``prepare`` convolves the sublayer's (normed) input and derives, from that same
input, the kernel ``finish`` convolves the sublayer's output with. Each side's kernel has
``conv_kernel_size`` taps; tap t at block slot p reads slot p - t of the same block (none before
slot 0), with coefficient ``base[t, c] + delta[p, t, g(c)]``: a learned per-channel base plus a
per-slot offset shared by the ``conv_group_size`` channels of group g, projected from the
sublayer's input at slot p. The base starts as the identity (tap 0 = 1, others 0) and the
projection at zero, so a fresh DFlash2 layer equals its DFlash layer. Only the block stream is
convolved: context keys and values are the plain projections of the context rows, as served.

Parameter names are the ones vLLM's ``DFlash2Qwen3ForCausalLM`` loads
(``layers.{i}.attention_conv.base_kernel``, ``.kernel_projection.weight``; ``mlp_conv``).
Shape suffixes follow the legend in ``sparkforge.trainer.draft.model``; here T is the taps and
G the channel groups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from sparkforge.trainer.draft.block_layout import BLOCK_LAYOUTS
from sparkforge.trainer.draft.config import SharedDraftConfig


def block_causal_conv(x_BQH: torch.Tensor, delta_BQTG: torch.Tensor, base_TH: torch.Tensor,
                      block_size: int) -> torch.Tensor:
    """``out[p] = sum_t (base[t] + delta[p, t]) * x[p - t]`` within each block of the stream.

    Args:
        x_BQH: The block stream, Q = (blocks) x ``block_size`` rows, blocks contiguous.
        delta_BQTG: Per-row, per-tap offsets of each channel group.
        base_TH: Per-tap, per-channel base coefficients.
        block_size: Rows per block; a tap never reaches into the previous block.
    """
    b, q, h = x_BQH.shape
    taps, groups = delta_BQTG.shape[-2:]
    x_BNKGC = x_BQH.view(b, q // block_size, block_size, groups, h // groups)
    coef_BNKTGC = (base_TH.view(taps, groups, -1).to(x_BQH.dtype)
                   + delta_BQTG.view(b, q // block_size, block_size, taps, groups)[..., None])
    out = coef_BNKTGC[:, :, :, 0] * x_BNKGC
    for tap in range(1, taps):
        # Slot p reads slot p - tap; the first ``tap`` slots of a block read zeros.
        shifted = F.pad(x_BNKGC, (0, 0, 0, 0, tap, 0))[:, :, :block_size]
        out = out + coef_BNKTGC[:, :, :, tap] * shifted
    return out.reshape(b, q, h)


class BlockConv(nn.Module):
    """The two convolutions around one sublayer, driven by one projection of its input.

    Args:
        hidden_size: H.
        taps: Taps of each side's kernel (``conv_kernel_size``).
        group_size: Channels sharing a coefficient offset (``conv_group_size``); divides H.
        block_size: Rows per block of the stream (the draft's ``block_size``).
    """

    def __init__(self, hidden_size: int, *, taps: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.taps, self.groups, self.block_size = taps, hidden_size // group_size, block_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity on both sides: tap 0 = 1, later taps 0, no token-dependent offset."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x_BQH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input, and the offsets [B, Q, T, G] ``finish`` uses."""
        b, q, _ = x_BQH.shape
        delta = self.kernel_projection(x_BQH).view(b, q, 2, self.taps, self.groups)
        return (block_causal_conv(x_BQH, delta[:, :, 0], self.base_kernel[0], self.block_size),
                delta[:, :, 1])

    def finish(self, y_BQH: torch.Tensor, delta_BQTG: torch.Tensor) -> torch.Tensor:
        """The convolved sublayer output."""
        return block_causal_conv(y_BQH, delta_BQTG, self.base_kernel[1], self.block_size)


def block_convs(cfg: SharedDraftConfig) -> tuple[BlockConv | None, BlockConv | None]:
    """A layer's ``attention_conv`` and ``mlp_conv`` (both None unless the layout has them)."""
    if not BLOCK_LAYOUTS[cfg.layout].block_convs:
        return None, None
    sizes = {"taps": cfg.conv_kernel_size, "group_size": cfg.conv_group_size,
             "block_size": cfg.block_size}
    return BlockConv(cfg.hidden_size, **sizes), BlockConv(cfg.hidden_size, **sizes)


def around(conv: BlockConv | None, sublayer: Callable[[torch.Tensor], torch.Tensor],
           x_BQH: torch.Tensor) -> torch.Tensor:
    """``sublayer(x)``, wrapped in ``conv``'s two convolutions when the layer has one."""
    if conv is None:
        return sublayer(x_BQH)
    prepared, delta = conv.prepare(x_BQH)
    return conv.finish(sublayer(prepared), delta)
