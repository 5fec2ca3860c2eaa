"""What a training forward reads from a batch: its tensors, the anchors it may be given, the
rows' padding/packing geometry and the blocks placed on those rows.

Shape suffixes follow the legend in ``sparkforge.trainer.draft.model``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from sparkforge.trainer.draft.anchors import document_bounds, sample_anchors


@dataclass(frozen=True)
class DraftBatch:
    """One collated batch's tensors, as the training forward reads them."""

    input_ids: torch.Tensor
    """[B, S] int, unshifted."""
    loss_mask: torch.Tensor
    """[B, S] 0/1, aligned with input_ids."""
    target_hidden_states: torch.Tensor
    """[B, S, F*H] features concatenated in id order."""
    target_last_hidden_states: torch.Tensor | None = None
    """[B, S, H] the target's lm_head input; needed for the L1 term, the confidence label and
    the acceptance metrics."""
    attention_mask: torch.Tensor | None = None
    """[B, S] 1 on real tokens, 0 on right padding (see ``RowGeometry``)."""
    position_ids: torch.Tensor | None = None
    """[B, S] per-document positions of a packed row (default 0..S-1)."""
    document_ids: torch.Tensor | None = None
    """[B, S] equal on each document of a packed row (contiguous runs). A block then sees only
    its anchor's document, and an anchor needs its first target (DSpark) or its block (DFlash)
    inside it."""

    @classmethod
    def of(cls, batch: DraftBatch | Mapping[str, torch.Tensor]) -> DraftBatch:
        """``batch`` itself, or the fields of a collated batch (its other keys ignored)."""
        if isinstance(batch, DraftBatch):
            return batch
        return cls(**{f.name: batch[f.name] for f in fields(cls) if f.name in batch})


@dataclass(frozen=True)
class FixedAnchors:
    """Anchors a forward is given instead of sampling its own (e.g. another forward's)."""

    positions: torch.Tensor
    """[B, A] int64 anchor positions, sorted (0 for dummy blocks)."""
    keep: torch.Tensor
    """[B, A] bool, False for dummy blocks."""


@dataclass(frozen=True)
class RowGeometry:
    """Where a batch's rows count: what ``attention_mask``, ``position_ids`` and
    ``document_ids`` say together about padded and packed rows."""

    loss_mask: torch.Tensor
    """[B, S] the loss mask with right padding removed, so no anchor and no label lies in it
    (context is strictly before the anchor, so padding is never visible)."""
    positions_BS: torch.Tensor
    """[B, S] per-document positions of a packed row (default 0..S-1) for the context and
    block RoPE."""
    starts_BS: torch.Tensor | None
    """[B, S] first position of each token's document (None: one document per row)."""
    ends_BS: torch.Tensor | None
    """[B, S] end (exclusive) of each token's document or of the real tokens (None: the row's
    end); labels, teacher targets and the Markov head's previous tokens stop there."""


@dataclass(frozen=True)
class Blocks:
    """The batch's blocks: their anchors and the document bounds each one sees."""

    anchors: torch.Tensor
    """[B, A] int64 anchor positions, sorted (0 for dummy blocks)."""
    keep: torch.Tensor
    """[B, A] bool, False for dummy blocks."""
    anchor_ids_BA: torch.Tensor
    """[B, A] the data token at each anchor."""
    starts_BA: torch.Tensor | None
    """[B, A] first position of the anchor's document (None: the row's start)."""
    ends_BA: torch.Tensor | None
    """[B, A] end (exclusive) of the anchor's document (None: the row's end)."""


def row_geometry(batch: DraftBatch) -> RowGeometry:
    """The rows' geometry from the batch's optional padding and packing tensors."""
    input_ids, loss_mask, attention_mask = batch.input_ids, batch.loss_mask, batch.attention_mask
    if attention_mask is not None:
        loss_mask = loss_mask * attention_mask.to(loss_mask.dtype)
    rows, seq_len = input_ids.shape
    starts_BS = ends_BS = None
    if batch.document_ids is not None:
        starts_BS, ends_BS = document_bounds(batch.document_ids)
    elif attention_mask is not None:
        ends_BS = attention_mask.long().sum(dim=1, keepdim=True).expand(rows, seq_len)
    positions_BS = batch.position_ids if batch.position_ids is not None else torch.arange(
        seq_len, device=input_ids.device).expand(rows, seq_len)
    return RowGeometry(loss_mask=loss_mask, positions_BS=positions_BS, starts_BS=starts_BS,
                       ends_BS=ends_BS)


def place_blocks(input_ids: torch.Tensor, rows: RowGeometry, candidates_BC: torch.Tensor,
                 num_anchors: int, fixed: FixedAnchors | None,
                 generator: torch.Generator | None) -> Blocks:
    """The ``fixed`` anchors, or ``num_anchors`` sampled among the candidates, with their
    bounds."""
    if fixed is None:
        fixed = FixedAnchors(*sample_anchors(rows.loss_mask, num_anchors, generator=generator,
                                             candidates_BC=candidates_BC))
    anchors = fixed.positions
    return Blocks(
        anchors=anchors, keep=fixed.keep, anchor_ids_BA=torch.gather(input_ids, 1, anchors),
        starts_BA=None if rows.starts_BS is None else torch.gather(rows.starts_BS, 1, anchors),
        ends_BA=None if rows.ends_BS is None else torch.gather(rows.ends_BS, 1, anchors))
