"""Acceptance, tau, calibration and sampler metrics as unreduced numerator/denominator sums.

Sums are accumulated over a log window and over ranks, then divided once (never averaged per
batch). Shape suffixes follow the legend in ``sparkforge.trainer.draft.model``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sparkforge.trainer.draft.model import DraftOutput
from sparkforge.trainer.draft.selector import ServedAcceptance

MetricSums = dict[str, torch.Tensor]


@torch.no_grad()
def metric_sums(
    out: DraftOutput, accept_BAK: torch.Tensor | None, weights_BAK: torch.Tensor,
    selector: ServedAcceptance | None = None,
) -> MetricSums:
    """Numerators and denominators for one micro-batch (fp64, detached).

    Args:
        out: The model output.
        accept_BAK: Analytic acceptance c* from the loss (None without teacher logits: the
            acceptance and calibration sums are then zero).
        weights_BAK: Decay weights times eval_mask (the loss's ``weights``).
        selector: The candidate selector's served acceptance and its ceilings from the loss
            (DFlash2; None without the selector or teacher logits).
    """
    ev = out.eval_mask.double()
    k = ev.shape[-1]
    acc = accept_BAK.double() if accept_BAK is not None else torch.zeros_like(ev)
    w = weights_BAK.double()
    surv_acc = torch.cumprod(acc * ev, dim=-1)
    block_on = (out.block_keep_mask & out.eval_mask.any(-1)).double()
    sums: MetricSums = {
        "accept_num": (acc * ev).sum((0, 1)) if accept_BAK is not None else ev.new_zeros(k),
        "accept_den": ev.sum((0, 1)) if accept_BAK is not None else ev.new_zeros(k),
        "tau_num": ((1.0 + surv_acc.sum(-1)) * block_on).sum(),
        "tau_den": block_on.sum(),
        "valid_anchors": out.num_valid_anchors.double().sum(),
        "anchor_candidates": ev.new_tensor(float(ev.shape[0] * max(out.seq_len - 1, 0))),
        "kept_anchors": out.block_keep_mask.double().sum(),
        "anchor_slots": ev.new_tensor(float(out.block_keep_mask.numel())),
        "supervised_slots": ev.sum(),
    }
    if accept_BAK is None:
        sums["tau_num"] = sums["tau_den"] = ev.new_zeros(())
    if out.candidate_ids is not None:
        sums |= selector_sums(out, ev, block_on, selector)
    if out.confidence_logits is not None:
        conf = torch.sigmoid(out.confidence_logits.double())
        surv_conf = torch.cumprod(conf * ev, dim=-1)
        sums["conf_abs_num"] = ((conf - acc).abs() * w).sum()
        sums["conf_bias_num"] = ((conf - acc) * w).sum()
        sums["conf_cumprod_bias_num"] = ((surv_conf - surv_acc) * w).sum()
        sums["conf_den"] = w.sum() if accept_BAK is not None else ev.new_zeros(())
    return sums


def selector_sums(out: DraftOutput, ev_BAK: torch.Tensor, block_on_BA: torch.Tensor,
                  served: ServedAcceptance | None) -> MetricSums:
    """The candidate selector's sums: its served acceptance by position and its tau (as
    ``accept_*`` / ``tau_*``), the teacher's mass on the candidates and in its own top-k (the
    ceilings of any rerank and of any draft with this top-k), and how often the top-k holds the
    data token (recall)."""
    assert out.candidate_ids is not None
    hit = (out.candidate_ids == out.target_ids[..., None]).any(-1).double()
    parts = [torch.zeros_like(ev_BAK)] * 3 if served is None else [x.double() for x in served]
    acc, cand_mass, top_mass = parts
    on = float(served is not None)
    surv = torch.cumprod(acc * ev_BAK, dim=-1)
    return {"selector_accept_num": (acc * ev_BAK).sum((0, 1)) * on,
            "selector_accept_den": ev_BAK.sum((0, 1)) * on,
            "selector_tau_num": ((1.0 + surv.sum(-1)) * block_on_BA).sum() * on,
            "selector_tau_den": block_on_BA.sum() * on,
            "candidate_mass_num": (cand_mass * ev_BAK).sum(),
            "top_k_mass_num": (top_mass * ev_BAK).sum(),
            "candidate_hit_num": (hit * ev_BAK).sum()}


def accumulate(total: MetricSums | None, new: MetricSums) -> MetricSums:
    """Add one micro-batch's sums into a window total."""
    if total is None:
        return {key: value.clone() for key, value in new.items()}
    return {key: total[key] + new[key] for key in total}


def all_reduce_sums(sums: MetricSums, group: dist.ProcessGroup | None = None) -> MetricSums:
    """Sum every entry over ranks with one collective (identity without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return sums
    keys = sorted(sums)
    flat = torch.cat([sums[key].reshape(-1) for key in keys])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    out, i = {}, 0
    for key in keys:
        n = sums[key].numel()
        out[key] = flat[i:i + n].view_as(sums[key])
        i += n
    return out


def metric_ratios(sums: MetricSums) -> dict[str, float]:
    """Form every ratio once; entries whose denominator is 0 are omitted."""
    res: dict[str, float] = {}
    num_k, den_k = sums["accept_num"], sums["accept_den"]
    for k in range(num_k.numel()):
        if den_k[k] > 0:
            res[f"accept_rate@{k}"] = float(num_k[k] / den_k[k])
    pairs = {
        "accept_rate": (num_k.sum(), den_k.sum()),
        "tau": (sums["tau_num"], sums["tau_den"]),
        "valid_anchor_ratio": (sums["valid_anchors"], sums["anchor_candidates"]),
        "kept_anchor_ratio": (sums["kept_anchors"], sums["anchor_slots"]),
        "supervised_per_block": (sums["supervised_slots"], sums["kept_anchors"]),
    }
    if "selector_accept_num" in sums:
        num_s, den_s = sums["selector_accept_num"], sums["selector_accept_den"]
        res |= {f"selector_accept_rate@{k}": float(num_s[k] / den_s[k])
                for k in range(num_s.numel()) if den_s[k] > 0}
        pairs["selector_accept_rate"] = (num_s.sum(), den_s.sum())
        pairs["selector_tau"] = (sums["selector_tau_num"], sums["selector_tau_den"])
        pairs["candidate_recall"] = (sums["candidate_hit_num"], sums["supervised_slots"])
        pairs["candidate_teacher_mass"] = (sums["candidate_mass_num"], den_s.sum())
        pairs["teacher_top_k_mass"] = (sums["top_k_mass_num"], den_s.sum())
    if "conf_den" in sums:
        pairs["confidence_abs_error"] = (sums["conf_abs_num"], sums["conf_den"])
        pairs["confidence_bias"] = (sums["conf_bias_num"], sums["conf_den"])
        pairs["confidence_cumprod_bias"] = (sums["conf_cumprod_bias_num"], sums["conf_den"])
    for name, (num, den) in pairs.items():
        if den > 0:
            res[name] = float(num / den)
    for name in ("valid_anchors", "kept_anchors", "supervised_slots"):
        res[name] = float(sums[name])
    return res
