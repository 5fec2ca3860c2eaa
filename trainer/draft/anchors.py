"""Anchor sampling, the block layouts of DSpark and DFlash, and the per-slot evaluation mask.

Shape suffixes follow the legend in ``sparkforge.trainer.draft.model``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class BlockLayout:
    """Which slots of a block ``[anchor, MASK x (block_size-1)]`` draft, and which anchors train.

    Draft position j always predicts the token at anchor+j+1; the layouts differ in the block
    slot that computes it.
    """

    first_draft_slot: int
    """Block slot of draft position 0: 0 for DSpark (the anchor slot predicts anchor+1, so a
    block drafts block_size tokens), 1 for DFlash (slot k predicts the token at anchor+k, the
    anchor slot drafts nothing, so a block drafts block_size-1 tokens)."""
    full_block: bool
    """An anchor needs its whole block inside the sequence (DFlash), instead of only a
    supervised first target (DSpark)."""
    prefix_mask: bool
    """A draft position trains only if every earlier one of its block does (DSpark's cumulative
    product); DFlash masks each position on its own."""

    def num_drafts(self, block_size: int) -> int:
        """Draft tokens per block."""
        return block_size - self.first_draft_slot


DSPARK_LAYOUT = BlockLayout(first_draft_slot=0, full_block=False, prefix_mask=True)
DFLASH_LAYOUT = BlockLayout(first_draft_slot=1, full_block=True, prefix_mask=False)


def anchor_candidates(
    loss_mask_BS: torch.Tensor, layout: BlockLayout = DSPARK_LAYOUT, *, block_size: int = 1,
    lengths_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Valid anchors among positions ``0..S-2``.

    DSpark: the anchor token and its first target are both supervised. DFlash: the anchor token
    is supervised and its whole block ``anchor .. anchor+block_size-1`` lies inside the row.

    Args:
        loss_mask_BS: [B, S] 0/1 mask (padding must already be 0).
        layout: The block layout.
        block_size: K (read by the full-block rule).
        lengths_B: [B] real row lengths (right padding excluded); default S.

    Returns:
        [B, S-1] bool; DSpark ``[1,1,0,1,1,1] -> [T,F,F,T,T]``.
    """
    sup = loss_mask_BS > 0.5
    if not layout.full_block:
        return sup[:, :-1] & sup[:, 1:]
    batch, seq_len = loss_mask_BS.shape
    if lengths_B is None:
        lengths_B = torch.full((batch,), seq_len, device=loss_mask_BS.device)
    last_C = torch.arange(seq_len - 1, device=loss_mask_BS.device) + block_size - 1
    return sup[:, :-1] & (last_C[None, :] < lengths_B[:, None])


def sample_anchors(
    loss_mask_BS: torch.Tensor, num_anchors: int, *, generator: torch.Generator | None = None,
    candidates_BC: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform sampling without replacement among valid candidates, fixed count, sorted.

    Invalid candidates get key 2.0 so they sort after every valid one; the first ``A`` keys are
    taken, invalid picks and padding become the sentinel ``S+1`` before the ascending sort, and
    dropped ("dummy") anchors are finally set to position 0 with keep False. Never raises.

    Args:
        loss_mask_BS: [B, S] 0/1 mask (padding must already be 0).
        num_anchors: A.
        generator: RNG (default: the global torch RNG).
        candidates_BC: [B, S-1] valid anchors; default ``anchor_candidates(loss_mask_BS)``.

    Returns:
        anchor_positions [B, A] int64, block_keep_mask [B, A] bool.
    """
    batch, seq_len = loss_mask_BS.shape
    device = loss_mask_BS.device
    if candidates_BC is not None:
        valid_BC = candidates_BC
    else:
        valid_BC = anchor_candidates(loss_mask_BS) if seq_len >= 2 else loss_mask_BS[:, :0] > 0
    num_cand = valid_BC.shape[1]
    keys_BC = torch.rand(batch, num_cand, generator=generator, device=device)
    keys_BC = keys_BC.masked_fill(~valid_BC, 2.0)
    take = min(num_anchors, num_cand)
    order_BC = torch.argsort(keys_BC, dim=1)[:, :take]
    picked_valid = torch.gather(valid_BC, 1, order_BC)
    sentinel = seq_len + 1
    picks = torch.where(picked_valid, order_BC, torch.full_like(order_BC, sentinel))
    if take < num_anchors:
        pad = torch.full((batch, num_anchors - take), sentinel, dtype=picks.dtype, device=device)
        picks = torch.cat([picks, pad], dim=1)
    anchors_BA = torch.sort(picks, dim=1).values
    count_B = valid_BC.sum(dim=1).clamp(max=num_anchors)
    keep_BA = torch.arange(num_anchors, device=device)[None, :] < count_B[:, None]
    anchors_BA = torch.where(keep_BA, anchors_BA, torch.zeros_like(anchors_BA))
    return anchors_BA.long(), keep_BA


def label_indices(
    anchors_BA: torch.Tensor, keep_BA: torch.Tensor, num_drafts: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft position k predicts the token at anchor+k+1 (k < ``num_drafts``).

    Returns:
        label_idx [B, A, K] (may be >= S), safe_idx [B, A, K] clamped to S-1 and 0 for dummies.
    """
    offs_K = torch.arange(1, num_drafts + 1, device=anchors_BA.device)
    label_BAK = anchors_BA[..., None] + offs_K
    safe_BAK = label_BAK.clamp(max=seq_len - 1)
    safe_BAK = torch.where(keep_BA[..., None], safe_BAK, torch.zeros_like(safe_BAK))
    return label_BAK, safe_BAK


def build_eval_mask(
    loss_mask_BS: torch.Tensor, anchors_BA: torch.Tensor, keep_BA: torch.Tensor, num_drafts: int,
    *, prefix: bool = True,
) -> torch.Tensor:
    """Supervised draft positions: in range, label supervised, block kept.

    With ``prefix`` (DSpark) a position counts only if it and every earlier position of its
    block count (a cumulative product), so the mask is a contiguous prefix per block and
    position 0 of a kept DSpark anchor is always on. DFlash masks each position on its own.

    Returns:
        [B, A, K] bool (K = ``num_drafts``).
    """
    seq_len = loss_mask_BS.shape[1]
    label_BAK, safe_BAK = label_indices(anchors_BA, keep_BA, num_drafts, seq_len)
    sup_BAK = torch.gather(loss_mask_BS, 1, safe_BAK.flatten(1)).view_as(safe_BAK) > 0.5
    on_BAK = (label_BAK < seq_len) & sup_BAK & keep_BA[..., None]
    if not prefix:
        return on_BAK
    return torch.cumprod(on_BAK.to(torch.int32), dim=-1).bool()
