"""Anchor sampling under a block layout (``block_layout``) and the per-slot evaluation mask.

Shape suffixes follow the legend in ``sparkforge.trainer.draft.model``.
"""

from __future__ import annotations

import torch

from sparkforge.trainer.draft.block_layout import DSPARK_LAYOUT, BlockLayout


def document_bounds(document_ids_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First position and exclusive end of the document holding each position of a packed row.

    Args:
        document_ids_BS: [B, S] int, equal on the positions of one document (contiguous runs;
            padding is its own run).

    Returns:
        start_BS, end_BS [B, S] int64; ``[7,7,7,9,9] -> start [0,0,0,3,3], end [3,3,3,5,5]``.
    """
    batch, seq_len = document_ids_BS.shape
    pos_S = torch.arange(seq_len, device=document_ids_BS.device).expand(batch, seq_len)
    new = torch.ones_like(document_ids_BS, dtype=torch.bool)
    new[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    start_BS = torch.cummax(torch.where(new, pos_S, torch.zeros_like(pos_S)), dim=1).values
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    ends_rev = torch.where(last, pos_S + 1, torch.full_like(pos_S, seq_len)).flip(1)
    return start_BS, torch.cummin(ends_rev, dim=1).values.flip(1)


def anchor_candidates(
    loss_mask_BS: torch.Tensor, layout: BlockLayout = DSPARK_LAYOUT, *, block_size: int = 1,
    ends_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """Valid anchors among positions ``0..S-2``.

    DSpark: the anchor token and its first target are both supervised and in one document.
    DFlash: the anchor token is supervised and its whole block ``anchor .. anchor+block_size-1``
    lies inside its document.

    Args:
        loss_mask_BS: [B, S] 0/1 mask (padding must already be 0).
        layout: The block layout.
        block_size: K (read by the full-block rule).
        ends_BS: [B, S] exclusive end of each position's document (a packed row), or of the
            row's real tokens (right padding excluded); default S.

    Returns:
        [B, S-1] bool; DSpark ``[1,1,0,1,1,1] -> [T,F,F,T,T]``.
    """
    sup = loss_mask_BS > 0.5
    seq_len = sup.shape[1]
    ok_BC = sup[:, :-1] if layout.full_block else sup[:, :-1] & sup[:, 1:]
    reach = block_size - 1 if layout.full_block else 1
    last_C = torch.arange(seq_len - 1, device=sup.device) + reach
    ends: torch.Tensor | int = seq_len if ends_BS is None else ends_BS[:, :-1]
    return ok_BC & (last_C < ends)


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
    anchors_BA: torch.Tensor, keep_BA: torch.Tensor, num_drafts: int, seq_len: int,
    ends_BA: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft position k predicts the token at anchor+k+1 (k < ``num_drafts``).

    Args:
        ends_BA: [B, A] exclusive end of each anchor's document (default S), so no index
            reaches into the next document of a packed row.

    Returns:
        label_idx [B, A, K] (may reach the end), safe_idx [B, A, K] clamped to the end - 1
        and the anchor itself for dummies (position 0 as sampled).
    """
    offs_K = torch.arange(1, num_drafts + 1, device=anchors_BA.device)
    label_BAK = anchors_BA[..., None] + offs_K
    if ends_BA is None:
        safe_BAK = label_BAK.clamp(max=seq_len - 1)
    else:
        safe_BAK = torch.minimum(label_BAK, ends_BA[..., None] - 1)
    safe_BAK = torch.where(keep_BA[..., None], safe_BAK, anchors_BA[..., None].expand_as(safe_BAK))
    return label_BAK, safe_BAK


def build_eval_mask(
    loss_mask_BS: torch.Tensor, anchors_BA: torch.Tensor, keep_BA: torch.Tensor, num_drafts: int,
    *, prefix: bool = True, ends_BA: torch.Tensor | None = None,
) -> torch.Tensor:
    """Supervised draft positions: inside the anchor's document, label supervised, block kept.

    With ``prefix`` (DSpark) a position counts only if it and every earlier position of its
    block count (a cumulative product), so the mask is a contiguous prefix per block and
    position 0 of a kept DSpark anchor is always on. DFlash masks each position on its own.

    ``ends_BA`` is each anchor's document end (default S, see ``label_indices``).

    Returns:
        [B, A, K] bool (K = ``num_drafts``).
    """
    seq_len = loss_mask_BS.shape[1]
    label_BAK, safe_BAK = label_indices(anchors_BA, keep_BA, num_drafts, seq_len, ends_BA)
    sup_BAK = torch.gather(loss_mask_BS, 1, safe_BAK.flatten(1)).view_as(safe_BAK) > 0.5
    end_BA1 = seq_len if ends_BA is None else ends_BA[..., None]
    on_BAK = (label_BAK < end_BA1) & sup_BAK & keep_BA[..., None]
    if not prefix:
        return on_BAK
    return torch.cumprod(on_BAK.to(torch.int32), dim=-1).bool()
