"""The DSpark objective: weighted CE + L1 to the teacher + BCE confidence, globally normalised.

Shape legend: B batch, A anchors, K block size, V vocab, N supervised rows (slots with weight > 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.utils.checkpoint import checkpoint

from sparkforge.trainer.model import DSparkOutput

EPS = 1e-6


@dataclass
class LossOutput:
    """The backward loss plus detached, locally normalised parts for logging."""

    loss: torch.Tensor
    """Scalar to backpropagate: world_size * sum_t alpha_t * num_t / (global D + 1e-6)."""
    logged_loss: torch.Tensor
    """Same formula with the local denominator and no world_size factor (detached)."""
    ce_loss: torch.Tensor
    l1_loss: torch.Tensor
    """Full L1 distance (= 2 TV); logged as ``tv_loss`` upstream."""
    confidence_loss: torch.Tensor
    accept_rate: torch.Tensor | None
    """[B, A, K] fp32 detached analytic acceptance c* (0 on unsupervised slots), or None."""
    weights: torch.Tensor
    """[B, A, K] fp32 decay weights times eval_mask."""
    local_denominator: torch.Tensor
    global_denominator: torch.Tensor


def decay_weights(eval_mask_BAK: torch.Tensor, gamma: float | None) -> torch.Tensor:
    """``eval_mask * exp(-k/gamma)`` in fp32 (k 0-indexed); ``eval_mask`` if gamma is unset/<= 0."""
    w = eval_mask_BAK.float()
    if gamma is None or gamma <= 0:
        return w
    k = torch.arange(w.shape[-1], device=w.device, dtype=torch.float32)
    return w * torch.exp(-k / gamma)


def l1_distance(draft_NV: torch.Tensor, target_NV: torch.Tensor) -> torch.Tensor:
    """Full L1 norm ``sum_v |softmax(draft) - softmax(target)|`` in fp32 -> [N] (unchunked)."""
    p_d = torch.softmax(draft_NV.float(), dim=-1)
    p_t = torch.softmax(target_NV.float(), dim=-1)
    return (p_d - p_t).abs().sum(-1)


def _row_terms(
    draft_NV: torch.Tensor, target_NV: torch.Tensor, ids_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    ce = F.cross_entropy(draft_NV.float(), ids_N, reduction="none")
    return ce, l1_distance(draft_NV, target_NV)


def chunked_row_terms(
    draft_NV: torch.Tensor, target_NV: torch.Tensor | None, ids_N: torch.Tensor, chunk_rows: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row CE and L1 computed ``chunk_rows`` rows at a time.

    Each chunk runs under non-reentrant checkpointing, so only one chunk's fp32 [chunk, V]
    temporaries are alive at once in forward and in backward; values and gradients are exact.

    Returns:
        ce [N] fp32 and l1 [N] fp32 (None without teacher logits).
    """
    ces, l1s = [], []
    for lo in range(0, draft_NV.shape[0], chunk_rows):
        d, i = draft_NV[lo:lo + chunk_rows], ids_N[lo:lo + chunk_rows]
        if target_NV is None:
            ces.append(checkpoint(F.cross_entropy, d.float(), i, reduction="none",
                                  use_reentrant=False))
            continue
        ce, l1 = checkpoint(_row_terms, d, target_NV[lo:lo + chunk_rows], i,
                            use_reentrant=False)
        ces.append(ce)
        l1s.append(l1)
    empty = draft_NV.new_zeros(0, dtype=torch.float32)
    ce_N = torch.cat(ces) if ces else empty
    if target_NV is None:
        return ce_N, None
    return ce_N, torch.cat(l1s) if l1s else empty


def global_denominator(
    local: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, int]:
    """Sum a detached denominator over data-parallel ranks; returns (global, world_size)."""
    if not (dist.is_available() and dist.is_initialized()):
        return local.detach(), 1
    total = local.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total, dist.get_world_size(group)


def compute_dspark_loss(
    out: DSparkOutput,
    *,
    ce_alpha: float = 0.1,
    l1_alpha: float = 0.9,
    confidence_alpha: float = 1.0,
    decay_gamma: float | None = 4.0,
    chunk_rows: int = 128,
    process_group: dist.ProcessGroup | None = None,
) -> LossOutput:
    """The three-term DSpark loss (dspark-algorithm.md section 8).

    Denominators are all-reduced (SUM) over ``process_group`` when torch.distributed is
    initialised; numerators stay local. The backward loss is multiplied by world_size so that
    DDP/FSDP gradient averaging yields exactly ``sum_ranks num / global D``.

    Raises:
        ValueError: The L1 term or the confidence head is on but there are no teacher logits.
    """
    needs_teacher = l1_alpha > 0 or (confidence_alpha > 0 and out.confidence_logits is not None)
    if needs_teacher and out.target_logits is None:
        raise ValueError("target_last_hidden_states is required when l1_alpha > 0 or the "
                         "confidence head is enabled")
    w_BAK = decay_weights(out.eval_mask, decay_gamma)
    rows = w_BAK.flatten().nonzero().squeeze(-1)
    w_N = w_BAK.flatten()[rows]
    v = out.draft_logits.shape[-1]
    draft_NV = out.draft_logits.reshape(-1, v)[rows]
    target_NV = None if out.target_logits is None else out.target_logits.reshape(-1, v)[rows]
    ce_N, l1_N = chunked_row_terms(draft_NV, target_NV, out.target_ids.flatten()[rows],
                                   chunk_rows)
    zero = w_N.sum() * 0.0
    ce_num = (ce_N * w_N).sum()
    l1_num = (l1_N * w_N).sum() if (l1_N is not None and l1_alpha > 0) else zero
    accept_BAK = None
    conf_num = zero
    if l1_N is not None:
        accept_N = (1.0 - 0.5 * l1_N.detach()).clamp(0.0, 1.0)
        accept_BAK = torch.zeros_like(w_BAK).flatten().index_copy(0, rows, accept_N)
        accept_BAK = accept_BAK.view_as(w_BAK)
        if out.confidence_logits is not None and confidence_alpha > 0:
            conf_N = out.confidence_logits.flatten()[rows]
            bce = F.binary_cross_entropy_with_logits(conf_N, accept_N, reduction="none")
            conf_num = (bce * w_N).sum()
    local_d = w_BAK.sum()
    global_d, world = global_denominator(local_d, process_group)
    weighted = ce_alpha * ce_num + l1_alpha * l1_num + confidence_alpha * conf_num
    local_den = local_d + EPS
    return LossOutput(
        loss=world * weighted / (global_d + EPS),
        logged_loss=(weighted / local_den).detach(),
        ce_loss=(ce_num / local_den).detach(),
        l1_loss=(l1_num / local_den).detach(),
        confidence_loss=(conf_num / local_den).detach(),
        accept_rate=accept_BAK,
        weights=w_BAK,
        local_denominator=local_d.detach(),
        global_denominator=global_d,
    )
