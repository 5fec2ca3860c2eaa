"""Teacher-forced metrics of a cache's eval split, with the training run's loss settings.

accept_rate@k, tau (over every block, and over full blocks, each with its interval over eval
samples; by context length and by kind of turn), the confidence head's calibration, the
verification-policy table, and each batch's
blocks by slot (the confidence head's logit, the draft's top probability, the acceptance) that
``sparkforge.trainer.eval.head_calibration`` fits STS on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sparkforge.trainer.data import CacheStream, load_split_index
from sparkforge.trainer.draft.draft_batch import DraftBatch
from sparkforge.trainer.eval.acceptance import calibration_summary
from sparkforge.trainer.eval.bootstrap import ratio_ci
from sparkforge.trainer.eval.calibration import policy_table
from sparkforge.trainer.eval.context_buckets import forced_buckets
from sparkforge.trainer.eval.head_calibration import SlotRows, forced_rows
from sparkforge.trainer.eval.matched import FORCED_TEMPERATURE
from sparkforge.trainer.eval.report import reliability_bins
from sparkforge.trainer.eval.turn_kinds import TurnTags, by_kind
from sparkforge.trainer.job_config import EvalConfig
from sparkforge.trainer.loader_settings import LoaderSettings
from sparkforge.trainer.loss import compute_dspark_loss
from sparkforge.trainer.metrics import accumulate, metric_ratios, metric_sums
from sparkforge.trainer.run_config import LossSpec


def teacher_forced(draft: Any, reader: Any, cfg: EvalConfig, loss: LossSpec,
                   device: torch.device, tags: TurnTags
                   ) -> tuple[dict[str, Any], list[SlotRows]]:
    """The ``teacher_forced`` report section and each batch's blocks by slot."""
    settings = LoaderSettings(batch_size=4, batching="pad", num_workers=0, read_ahead_units=1,
                              seed=cfg.seed)
    stream = CacheStream(reader, load_split_index(reader, "eval"), settings, rank=0,
                         world_size=1, shuffle=False)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    sums, blocks, per_sample, by_anchor, kinds, selector = None, [], [], [], [], []
    with torch.no_grad():
        for i, batch in enumerate(stream):
            if cfg.max_eval_batches is not None and i >= cfg.max_eval_batches:
                break
            b = {k: v.to(device) for k, v in batch.items()}
            out = draft(DraftBatch(b["input_ids"], b["loss_mask"], b["target_hidden_states"],
                                   b["target_last_hidden_states"],
                                   attention_mask=b["attention_mask"]), generator=gen)
            res = compute_dspark_loss(out, loss)
            sums = accumulate(sums, metric_sums(out, res.accept_rate, res.weights, res.selector))
            if res.accept_rate is not None:
                blocks.append(block_rows(out, res.accept_rate))
                per_sample.append(sample_tau_sums(out, res.accept_rate))
                by_anchor.append(_anchor_rows(out, res.accept_rate))
                kinds += [tags.kinds(ids[mask > 0]) for ids, mask in zip(
                    batch["input_ids"], batch["loss_mask"], strict=True)]
            if res.selector is not None:
                selector.append(sample_tau_sums(out, res.selector.accept))
    if sums is None:
        return {}, []
    ratios = metric_ratios(sums)
    report: dict[str, Any] = {
        "metrics": ratios,
        "accept_rate_by_position": [ratios.get(f"accept_rate@{j}", 0.0)
                                    for j in range(draft.num_draft_tokens)]}
    if per_sample:
        report.update(_tau_intervals(per_sample, cfg.seed))
        num, den = (np.concatenate(parts) for parts in list(zip(*per_sample, strict=True))[:2])
        report["by_context"] = forced_buckets(by_anchor, cfg.context_buckets, seed=cfg.seed)
        report["by_turn"] = by_kind(num, den, kinds, unit="samples", seed=cfg.seed)
    if selector:
        report["selector"] = _selector_report(ratios, selector, draft.num_draft_tokens, cfg.seed)
    if blocks:
        report.update(_head_metrics(blocks, draft.confidence_head is not None, cfg))
    return report, [forced_rows(*parts) for parts in blocks]


def _selector_report(ratios: dict[str, float], per_sample: list[tuple[np.ndarray, ...]],
                     k: int, seed: int) -> dict[str, Any]:
    """A DFlash2 draft's teacher-forced acceptance as served (through its candidate selector):
    tau with its intervals, acceptance by position, the top-k recall of the data token, and
    the teacher's mass on the candidates and in its own top-k (the most any rerank of these
    candidates, and any draft with this top-k, could accept at a slot)."""
    return {"tau": ratios.get("selector_tau", 0.0),
            "accept_rate_by_position": [ratios.get(f"selector_accept_rate@{j}", 0.0)
                                        for j in range(k)],
            "candidate_recall": ratios.get("candidate_recall", 0.0),
            "candidate_teacher_mass": ratios.get("candidate_teacher_mass", 0.0),
            "teacher_top_k_mass": ratios.get("teacher_top_k_mass", 0.0),
            **_tau_intervals(per_sample, seed)}


def _tau_intervals(per_sample: list[tuple[np.ndarray, ...]], seed: int) -> dict[str, Any]:
    num, den, full_num, full_den = (np.concatenate(parts) for parts in zip(*per_sample,
                                                                           strict=True))
    full = int(full_den.sum())
    return {"samples": int((den > 0).sum()), "tau_ci95": list(ratio_ci(num, den, seed=seed)),
            "full_blocks": {"tau": float(full_num.sum() / full) if full else 0.0,
                            "tau_ci95": list(ratio_ci(full_num, full_den, seed=seed)),
                            "blocks": full, "cut_blocks": int(den.sum()) - full}}


def _head_metrics(blocks: list[tuple[np.ndarray, ...]], has_conf: bool,
                  cfg: EvalConfig) -> dict[str, Any]:
    """The policy table and (with a head) its calibration against the analytic acceptance."""
    accept, logits, _, valid = (np.concatenate(parts) for parts in zip(*blocks, strict=True))
    conf = 1.0 / (1.0 + np.exp(-logits)) if has_conf else None
    report: dict[str, Any] = {"policies": policy_table(accept, conf, valid,
                                                       cfg.policy_thresholds)}
    if conf is not None:
        report["calibration"] = {"temperature": FORCED_TEMPERATURE,
                                 **calibration_summary(conf[valid], accept[valid], events=False)}
        report["reliability"] = reliability_bins(conf[valid].tolist(), accept[valid].tolist())
    return report


def sample_tau_sums(out: Any, accept_BAK: torch.Tensor) -> tuple[np.ndarray, ...]:
    """Per sample of the batch: the sum of its blocks' expected lengths and its block count
    (the teacher-forced tau's numerator and denominator, as ``metric_sums`` counts them), then
    the same over its full blocks only (every slot inside the sample's supervised tokens).

    A block cut by the end of the sample (or of its reply) stops there as if rejected, which
    speculative decoding never does: its rounds are counted whole past ``max_new_tokens`` and
    eos. The full blocks are what the two taus are compared on
    (``sparkforge.trainer.eval.matched``)."""
    length, on = _block_lengths(out, accept_BAK)
    full = (on & out.eval_mask.bool().all(-1)).double()
    return tuple(t.cpu().numpy() for t in ((length * on).sum(-1), on.double().sum(-1),
                                           (length * full).sum(-1), full.sum(-1)))


def _block_lengths(out: Any, accept_BAK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's expected length ``1 + sum of surviving acceptances`` [B, A] and whether it
    counts (kept, with a supervised slot), as ``metric_sums`` counts tau."""
    surv = torch.cumprod(accept_BAK.double() * out.eval_mask.double(), dim=-1)
    return 1.0 + surv.sum(-1), out.block_keep_mask & out.eval_mask.any(-1)


def _anchor_rows(out: Any, accept_BAK: torch.Tensor) -> tuple[np.ndarray, ...]:
    """Per block: anchor position, expected length, whether it counts, acceptance and the
    supervised slots (``context_buckets.forced_buckets``' rows)."""
    length, on = _block_lengths(out, accept_BAK)
    return tuple(t.cpu().numpy() for t in (out.anchor_positions, length, on,
                                           accept_BAK.double(), out.eval_mask.double()))


def block_rows(out: Any, accept_BAK: torch.Tensor) -> tuple[np.ndarray, ...]:
    """Per kept block with data: acceptance, the head's logits (zeros without a head), the
    draft's top probability at T=1, and the valid slots."""
    valid_BAK = out.eval_mask > 0
    keep = valid_BAK.any(dim=-1)
    logits = (out.confidence_logits.float() if out.confidence_logits is not None
              else torch.zeros_like(accept_BAK))
    # one slot at a time: a [B, A, V] fp32 copy, not [B, A, K, V]
    max_q = torch.stack([torch.softmax(out.draft_logits[:, :, k].float(), -1).amax(-1)
                         for k in range(accept_BAK.shape[-1])], dim=-1)
    return tuple(t[keep].cpu().numpy() for t in (accept_BAK, logits, max_q, valid_BAK))
