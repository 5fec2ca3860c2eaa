"""The draft's layer stack run a few anchors at a time, so SDPA memory stays linear in context.

A block never sees another block: its queries attend the context before its anchor (within its
document) and its own block, and everything else in a draft layer acts on one token. So the
blocks of a row can go through the layers in chunks of anchors, each with a dense mask over only
the context its anchors can see (with sorted anchors, the chunk's last anchor bounds it). Each
chunk is recomputed in the backward pass (activation checkpointing), so one chunk's mask and
attention scores are alive at a time instead of the ``[A*K, S + A*K]`` grid of the whole row:
the projected context and its keys and values (linear in S) are computed once and shared.

Shape suffixes follow the legend in ``sparkforge.trainer.draft.model``; c is anchors per chunk.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.utils.checkpoint import checkpoint

from sparkforge.trainer.draft.attention_mask import dense_allowed

DENSE_GRID_LIMIT = 1 << 22
"""Query-key pairs of one row's dense mask above which ``sdpa`` runs chunked over anchors
(4M pairs: about 16 MiB of fp32 scores per head and row); below it one dense mask is used."""


def dense_grid(num_anchors: int, block_size: int, seq_len: int) -> int:
    """Query-key pairs of one row's dense mask: ``A*K`` queries over ``S + A*K`` keys."""
    num_q = num_anchors * block_size
    return num_q * (seq_len + num_q)


def anchor_chunk_size(num_anchors: int, block_size: int, seq_len: int) -> int | None:
    """Anchors per chunk for a row of ``seq_len``; None while the whole dense grid fits
    ``DENSE_GRID_LIMIT``. A chunk takes the most anchors whose grid over the whole context
    fits the limit (at least one)."""
    if dense_grid(num_anchors, block_size, seq_len) <= DENSE_GRID_LIMIT:
        return None
    best = max(1, DENSE_GRID_LIMIT // (block_size * (seq_len + block_size)))
    while best > 1 and dense_grid(best, block_size, seq_len) > DENSE_GRID_LIMIT:
        best -= 1
    return best


def _context_spans(anchors_BA: torch.Tensor, keep_BA: torch.Tensor,
                   starts_BA: torch.Tensor | None, chunk: int) -> list[tuple[int, int]]:
    """Per chunk: the context ``[lo, hi)`` its kept blocks can see (one host copy for all)."""
    hi_BA = torch.where(keep_BA, anchors_BA, 0).cpu()
    first_BA = torch.zeros_like(anchors_BA) if starts_BA is None else starts_BA
    lo_BA = torch.where(keep_BA, first_BA, torch.iinfo(torch.int64).max).cpu()
    spans = []
    for a0 in range(0, anchors_BA.shape[1], chunk):
        hi = int(hi_BA[:, a0:a0 + chunk].max())
        spans.append((min(int(lo_BA[:, a0:a0 + chunk].min()), hi), hi))  # dummies: no context
    return spans


def run_layers_by_anchor_chunks(
    stack: Any, x_BQH: torch.Tensor, pos_BQ: torch.Tensor, ctx_BSH: torch.Tensor,
    pos_BS: torch.Tensor, anchors_BA: torch.Tensor, keep_BA: torch.Tensor,
    starts_BA: torch.Tensor | None, *, chunk: int,
) -> torch.Tensor:
    """The block stream through every layer and the final norm, ``chunk`` anchors at a time.

    Equals ``passes.run_layers`` under ``dense_allowed``'s mask (a ``passes.DraftStack``
    ``stack``; the same arguments, anchors instead of the mask).

    Returns:
        [B, Q, H] post-norm hidden states of every block slot, in block order.
    """
    k = stack.config.block_size
    rope_c = stack.rotary_emb(pos_BS, x_BQH.dtype)
    ctx_kv = [tensor for layer in stack.layers
              for tensor in cast(Any, layer).key_values(ctx_BSH, *rope_c)]
    spans = _context_spans(anchors_BA, keep_BA, starts_BA, chunk)
    outs = []
    for i, (lo, hi) in enumerate(spans):
        a_sl, q_sl = slice(i * chunk, (i + 1) * chunk), slice(i * chunk * k, (i + 1) * chunk * k)
        starts_c = None if starts_BA is None else starts_BA[:, a_sl] - lo
        args = (x_BQH[:, q_sl], pos_BQ[:, q_sl], anchors_BA[:, a_sl] - lo, keep_BA[:, a_sl],
                starts_c, *ctx_kv)
        if torch.is_grad_enabled():
            out = checkpoint(_chunk_layers, stack, lo, hi, *args, use_reentrant=False)
        else:
            out = _chunk_layers(stack, lo, hi, *args)
        outs.append(out)
    return torch.cat(outs, dim=1)


def _chunk_layers(stack: Any, lo: int, hi: int, x: torch.Tensor, pos_BQ: torch.Tensor,
                  anchors_BA: torch.Tensor, keep_BA: torch.Tensor, starts_BA: torch.Tensor | None,
                  *ctx_kv: torch.Tensor) -> torch.Tensor:
    """One chunk's blocks through the layers over the context ``[lo, hi)`` (anchors shifted)."""
    mask = dense_allowed(anchors_BA, keep_BA, hi - lo, stack.config.block_size, starts_BA)
    rope_q = stack.rotary_emb(pos_BQ, x.dtype)
    for i, layer in enumerate(stack.layers):
        keys, values = ctx_kv[2 * i], ctx_kv[2 * i + 1]
        x = layer(x, rope_q, (keys[:, :, lo:hi], values[:, :, lo:hi]), mask)
    out: torch.Tensor = stack.norm(x)
    return out
