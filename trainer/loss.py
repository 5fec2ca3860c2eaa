"""The training objectives, globally normalised: DSpark's, DFlash's and DFlash2's.

DSpark: 0.1 CE + 0.9 L1 to the teacher + 1.0 BCE of the confidence head. DFlash: CE only.
DFlash2: DFlash's CE + 1.0 k-way CE of the candidate selector. All weight each supervised draft
position with the decay ``exp(-k/gamma)`` (see ``decay_weights``). ``LossSpec.objective`` picks
one. Shape suffixes follow the legend in
``sparkforge.trainer.draft.model`` (here W: the supervised rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

from sparkforge.trainer.draft.model import DraftOutput
from sparkforge.trainer.draft.selector import (
    ServedAcceptance,
    selector_cross_entropy,
    served_acceptance,
)
from sparkforge.trainer.run_config import LossSpec

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
    """Full L1 distance sum_v |p_draft - p_target| (= 2 x total variation); logged as l1_loss."""
    confidence_loss: torch.Tensor
    selector_loss: torch.Tensor
    """The candidate selector's k-way CE (0 without the selector)."""
    accept_rate: torch.Tensor | None
    """[B, A, K] fp32 detached analytic acceptance c* (0 on unsupervised slots), or None."""
    selector: ServedAcceptance | None
    """[B, A, K] fp32 each: the selector's top-k draft law as served at T=1, its acceptance and
    ceilings (0 on unsupervised slots), or None (no selector, or no teacher logits)."""
    weights: torch.Tensor
    """[B, A, K] fp32 decay weights times eval_mask."""
    local_denominator: torch.Tensor
    global_denominator: torch.Tensor


def decay_weights(eval_mask_BAK: torch.Tensor, gamma: float | None) -> torch.Tensor:
    """``eval_mask * exp(-k/gamma)`` in fp32 over draft positions k (0-indexed).

    DSpark's draft position k is block slot k: ``exp(-k/gamma)``. DFlash's is block slot
    ``s = k+1`` (slot 0, the anchor, drafts nothing and is no output), so this is DFlash's decay
    ``exp(-(s-1)/gamma)`` over slots ``s = 1..K-1``. ``eval_mask`` alone if gamma is unset/<= 0.
    """
    w = eval_mask_BAK.float()
    if gamma is None or gamma <= 0:
        return w
    k = torch.arange(w.shape[-1], device=w.device, dtype=torch.float32)
    return w * torch.exp(-k / gamma)


def l1_distance(draft_WV: torch.Tensor, target_WV: torch.Tensor) -> torch.Tensor:
    """Full L1 norm ``sum_v |softmax(draft) - softmax(target)|`` in fp32 -> [W] (unchunked)."""
    p_d = torch.softmax(draft_WV.float(), dim=-1)
    p_t = torch.softmax(target_WV.float(), dim=-1)
    return (p_d - p_t).abs().sum(-1)


def _row_ce(draft_WV: torch.Tensor, ids_W: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(draft_WV.float(), ids_W, reduction="none")


class _ChunkedRowTerms(torch.autograd.Function):
    """Per-row CE and L1 whose forward and backward each hold one chunk's fp32 temporaries.

    This is non-reentrant activation checkpointing per chunk, written out so the backward
    writes each chunk's gradient straight into one [W, V] buffer (checkpoint + split would keep
    every chunk's gradient and then a concatenated copy: twice the logits' size).
    """

    @staticmethod
    def forward(
        ctx: Any, draft_WV: torch.Tensor, target_WV: torch.Tensor | None, ids_W: torch.Tensor,
        chunk_rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(draft_WV, target_WV, ids_W)
        ctx.chunk_rows = chunk_rows
        ce = draft_WV.new_zeros(draft_WV.shape[0], dtype=torch.float32)
        l1 = torch.zeros_like(ce)
        for lo in range(0, draft_WV.shape[0], chunk_rows):
            hi = lo + chunk_rows
            ce[lo:hi] = _row_ce(draft_WV[lo:hi], ids_W[lo:hi])
            if target_WV is not None:
                l1[lo:hi] = l1_distance(draft_WV[lo:hi], target_WV[lo:hi])
        return ce, l1

    @staticmethod
    def backward(
        ctx: Any, g_ce: torch.Tensor, g_l1: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        draft_WV, target_WV, ids_W = ctx.saved_tensors
        grad = torch.empty_like(draft_WV)
        for lo in range(0, draft_WV.shape[0], ctx.chunk_rows):
            hi = lo + ctx.chunk_rows
            with torch.enable_grad():
                d = draft_WV[lo:hi].detach().requires_grad_()
                total = (_row_ce(d, ids_W[lo:hi]) * g_ce[lo:hi]).sum()
                if target_WV is not None:
                    total = total + (l1_distance(d, target_WV[lo:hi]) * g_l1[lo:hi]).sum()
                grad[lo:hi] = torch.autograd.grad(total, d)[0]
        return grad, None, None, None


def chunked_row_terms(
    draft_WV: torch.Tensor, target_WV: torch.Tensor | None, ids_W: torch.Tensor, chunk_rows: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row CE and L1 computed ``chunk_rows`` rows at a time, exact in value and gradient.

    No full-batch fp32 [W, V] temporary exists in forward or backward (see _ChunkedRowTerms).

    Returns:
        ce [W] fp32 and l1 [W] fp32 (None without teacher logits).
    """
    teacher = None if target_WV is None else target_WV.detach()
    ce, l1 = _ChunkedRowTerms.apply(
        draft_WV, teacher, ids_W, chunk_rows)
    return ce, None if target_WV is None else l1


def global_denominator(
    local: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, int]:
    """Sum a detached denominator over data-parallel ranks; returns (global, world_size)."""
    if not (dist.is_available() and dist.is_initialized()):
        return local.detach(), 1
    total = local.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total, dist.get_world_size(group)


def _confidence_terms(
    out: DraftOutput, l1_W: torch.Tensor, rows: torch.Tensor, w_BAK: torch.Tensor,
    confidence_alpha: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The detached label c* = clamp(1 - L1/2) scattered to [B, A, K], and per-row BCE (or None).

    The label carries no gradient; the BCE reaches the confidence head and through it the backbone.
    """
    accept_W = (1.0 - 0.5 * l1_W.detach()).clamp(0.0, 1.0)
    accept_BAK = torch.zeros_like(w_BAK).flatten().index_copy(0, rows, accept_W).view_as(w_BAK)
    if out.confidence_logits is None or confidence_alpha <= 0:
        return accept_BAK, None
    conf_W = out.confidence_logits.flatten()[rows]
    return accept_BAK, F.binary_cross_entropy_with_logits(conf_W, accept_W, reduction="none")


def _selector_terms(
    out: DraftOutput, rows: torch.Tensor, w_BAK: torch.Tensor, target_WV: torch.Tensor | None,
    spec: LossSpec,
) -> tuple[torch.Tensor, ServedAcceptance | None]:
    """The selector CE's numerator (decay-weighted sum over the supervised rows; 0 without the
    selector) and the selector's served acceptance and ceilings [B, A, K] (None without teacher
    logits)."""
    zero = w_BAK.sum() * 0.0
    if out.candidate_ids is None or out.candidate_scores is None:
        return zero, None
    top_k = out.candidate_ids.shape[-1]
    cand_WC = out.candidate_ids.reshape(-1, top_k)[rows]
    scores_WC1 = out.candidate_scores.reshape(-1, top_k + 1)[rows]
    num = zero
    if spec.selector_loss_alpha:
        ce_W = selector_cross_entropy(cand_WC, scores_WC1, out.target_ids.flatten()[rows])
        num = (ce_W * w_BAK.flatten()[rows]).sum()
    if target_WV is None:
        return num, None
    served_W = served_acceptance(cand_WC, scores_WC1[..., :top_k], target_WV, spec.l1_chunk_rows)
    return num, ServedAcceptance(*(torch.zeros_like(w_BAK).flatten().index_copy(0, rows, part_W)
                                   .view_as(w_BAK) for part_W in served_W))


def compute_dspark_loss(
    out: DraftOutput, spec: LossSpec, *, process_group: dist.ProcessGroup | None = None,
) -> LossOutput:
    """The run's objective ``spec`` (DSpark's three terms, or DFlash's CE; unset: DSpark).

    ``sum_t alpha_t * sum_slots w * term_t / (sum_slots w + 1e-6)`` over the supervised slots,
    with the terms CE to the data token, the full L1 distance to the teacher distribution and the
    BCE of the confidence head against the detached acceptance ``clamp(1 - L1/2, 0, 1)``, and the
    slot weights ``w = eval_mask * exp(-k/gamma)``. DFlash is the same sum with the CE term alone
    (its eval mask is per position, not a prefix: see ``anchors.BlockLayout``); on one rank it is
    the decay-weighted mean CE of the batch. DFlash2 adds the candidate selector's k-way CE
    (``selector.training_candidates``) to DFlash's, with the same weights and denominator.

    Denominators are all-reduced (SUM) over ``process_group`` when torch.distributed is
    initialised; numerators stay local. The backward loss is multiplied by world_size so that
    DDP/FSDP gradient averaging yields exactly ``sum_ranks num / global D``.

    Raises:
        ValueError: The L1 term or the confidence head is on but there are no teacher logits.
    """
    if spec.objective is None:
        spec = spec.with_objective("dspark")
    assert spec.ce_loss_alpha is not None
    assert spec.l1_loss_alpha is not None
    assert spec.confidence_head_alpha is not None
    assert spec.selector_loss_alpha is not None
    ce_alpha, l1_alpha = spec.ce_loss_alpha, spec.l1_loss_alpha
    confidence_alpha = spec.confidence_head_alpha
    needs_teacher = l1_alpha > 0 or (confidence_alpha > 0 and out.confidence_logits is not None)
    if needs_teacher and out.target_logits is None:
        raise ValueError("target_last_hidden_states is required when l1_alpha > 0 or the "
                         "confidence head is enabled")
    w_BAK = decay_weights(out.eval_mask, spec.loss_decay_gamma)
    rows = w_BAK.flatten().nonzero().squeeze(-1)
    w_W = w_BAK.flatten()[rows]
    v = out.draft_logits.shape[-1]
    draft_WV = out.draft_logits.reshape(-1, v)[rows]
    target_WV = None if out.target_logits is None else out.target_logits.reshape(-1, v)[rows]
    ce_W, l1_W = chunked_row_terms(draft_WV, target_WV, out.target_ids.flatten()[rows],
                                   spec.l1_chunk_rows)
    zero = w_W.sum() * 0.0
    ce_num = (ce_W * w_W).sum()
    l1_num = (l1_W * w_W).sum() if (l1_W is not None and l1_alpha > 0) else zero
    accept_BAK, conf_num = None, zero
    if l1_W is not None:
        accept_BAK, bce_W = _confidence_terms(out, l1_W, rows, w_BAK, confidence_alpha)
        if bce_W is not None:
            conf_num = (bce_W * w_W).sum()
    sel_num, served_BAK = _selector_terms(out, rows, w_BAK, target_WV, spec)
    local_d = w_BAK.sum()
    global_d, world = global_denominator(local_d, process_group)
    weighted = (ce_alpha * ce_num + l1_alpha * l1_num + confidence_alpha * conf_num
                + spec.selector_loss_alpha * sel_num)
    local_den = local_d + EPS
    return LossOutput(
        loss=world * weighted / (global_d + EPS),
        logged_loss=(weighted / local_den).detach(),
        ce_loss=(ce_num / local_den).detach(),
        l1_loss=(l1_num / local_den).detach(),
        confidence_loss=(conf_num / local_den).detach(),
        selector_loss=(sel_num / local_den).detach(),
        accept_rate=accept_BAK,
        selector=served_BAK,
        weights=w_BAK,
        local_denominator=local_d.detach(),
        global_denominator=global_d,
    )
