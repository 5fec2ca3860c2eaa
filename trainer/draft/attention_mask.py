"""The DSpark block attention rule, as a dense SDPA mask and as a flex-attention BlockMask.

KV layout ``[context (S) | block_0 (K) | ... | block_{A-1} (K)]``, Q layout ``[block_0 | ...]``.
A query of block n sees context key j iff start_n <= j < anchor_n and block n is kept, and every
key of its own block (bidirectional); nothing of other blocks. start_n is the first position of
the anchor's document (0 unless the row is packed), so a block never sees another document. A
dummy block still sees itself, so no row is ever fully masked (a dense softmax over an all -inf
row is NaN).

Shape suffixes follow the legend in ``sparkforge.trainer.draft.model``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def block_mask_mod(
    anchors_BA: torch.Tensor, keep_BA: torch.Tensor, seq_len: int, block_size: int,
    starts_BA: torch.Tensor | None = None,
) -> MaskMod:
    """The rule as a ``mask_mod(b, h, q, kv) -> bool``; works on scalars and broadcast grids.

    ``starts_BA``: [B, A] first position of each anchor's document (default 0).
    """
    lo_BA = torch.zeros_like(anchors_BA) if starts_BA is None else starts_BA

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        block = q_idx // block_size
        is_ctx = kv_idx < seq_len
        ctx_ok = (is_ctx & (kv_idx < anchors_BA[b, block]) & (kv_idx >= lo_BA[b, block])
                  & keep_BA[b, block])
        same_block = (kv_idx - seq_len) // block_size == block
        return ctx_ok | (~is_ctx & same_block)

    return mask_mod


def dense_allowed(
    anchors_BA: torch.Tensor, keep_BA: torch.Tensor, seq_len: int, block_size: int,
    starts_BA: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rule evaluated on the full grid: [B, 1, Q, S+Q] bool (True = may attend)."""
    batch, num_anchors = anchors_BA.shape
    num_q = num_anchors * block_size
    dev = anchors_BA.device
    mod = block_mask_mod(anchors_BA, keep_BA, seq_len, block_size, starts_BA)
    b = torch.arange(batch, device=dev)[:, None, None]
    q = torch.arange(num_q, device=dev)[None, :, None]
    kv = torch.arange(seq_len + num_q, device=dev)[None, None, :]
    return mod(b, torch.zeros((), dtype=torch.long, device=dev), q, kv)[:, None]


def flex_block_mask(
    anchors_BA: torch.Tensor, keep_BA: torch.Tensor, seq_len: int, block_size: int,
    starts_BA: torch.Tensor | None = None,
) -> BlockMask:
    """The rule as a flex-attention ``BlockMask`` over [B, 1, Q, S+Q]."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num_anchors = anchors_BA.shape
    num_q = num_anchors * block_size
    mod = block_mask_mod(anchors_BA, keep_BA, seq_len, block_size, starts_BA)
    return create_block_mask(
        mod, batch, None, num_q, seq_len + num_q, device=anchors_BA.device,
        _compile=anchors_BA.is_cuda,  # CPU: eager (inductor on CPU is slow to build)
    )
