"""Anchor sampling and the per-slot evaluation mask.

Shape suffixes follow the legend in ``sparkforge.trainer.model``.
"""

from __future__ import annotations

import torch


def anchor_candidates(loss_mask_BS: torch.Tensor) -> torch.Tensor:
    """Valid anchors: the anchor token and its first target are both supervised.

    Args:
        loss_mask_BS: [B, S] 0/1 mask (padding must already be 0).

    Returns:
        [B, S-1] bool; ``[1,1,0,1,1,1] -> [T,F,F,T,T]``.
    """
    sup = loss_mask_BS > 0.5
    return sup[:, :-1] & sup[:, 1:]


def sample_anchors(
    loss_mask_BS: torch.Tensor, num_anchors: int, *, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform sampling without replacement among valid candidates, fixed count, sorted.

    Invalid candidates get key 2.0 so they sort after every valid one; the first ``A`` keys are
    taken, invalid picks and padding become the sentinel ``S+1`` before the ascending sort, and
    dropped ("dummy") anchors are finally set to position 0 with keep False. Never raises.

    Returns:
        anchor_positions [B, A] int64, block_keep_mask [B, A] bool.
    """
    batch, seq_len = loss_mask_BS.shape
    device = loss_mask_BS.device
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
    anchors_BA: torch.Tensor, keep_BA: torch.Tensor, block_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot k predicts the token at anchor+k+1.

    Returns:
        label_idx [B, A, K] (may be >= S), safe_idx [B, A, K] clamped to S-1 and 0 for dummies.
    """
    offs_K = torch.arange(1, block_size + 1, device=anchors_BA.device)
    label_BAK = anchors_BA[..., None] + offs_K
    safe_BAK = label_BAK.clamp(max=seq_len - 1)
    safe_BAK = torch.where(keep_BA[..., None], safe_BAK, torch.zeros_like(safe_BAK))
    return label_BAK, safe_BAK


def build_eval_mask(
    loss_mask_BS: torch.Tensor, anchors_BA: torch.Tensor, keep_BA: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Supervised slots: in range, label supervised, block kept, then a cumulative product.

    A slot counts only if it and every earlier slot of its block count, so the mask is a
    contiguous prefix per block (slot 0 of a kept anchor is always on).

    Returns:
        [B, A, K] bool.
    """
    seq_len = loss_mask_BS.shape[1]
    label_BAK, safe_BAK = label_indices(anchors_BA, keep_BA, block_size, seq_len)
    sup_BAK = torch.gather(loss_mask_BS, 1, safe_BAK.flatten(1)).view_as(safe_BAK) > 0.5
    on_BAK = (label_BAK < seq_len) & sup_BAK & keep_BA[..., None]
    return torch.cumprod(on_BAK.to(torch.int32), dim=-1).bool()
