"""Metrics: acceptance, tau and calibration sums against loop references; ratio of sums."""

from __future__ import annotations

import math

import pytest
import torch

from sparkforge.trainer.draft.model import DraftOutput
from sparkforge.trainer.loss import compute_dspark_loss
from sparkforge.trainer.metrics import accumulate, metric_ratios, metric_sums
from sparkforge.trainer.run_config import LossSpec


def _output(seed: int, b: int = 3, a: int = 4, k: int = 5, v: int = 9) -> DraftOutput:
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(b, a, generator=g) > 0.25
    eval_mask = torch.cumprod((torch.rand(b, a, k, generator=g) > 0.15).int(), -1).bool()
    eval_mask &= keep[..., None]
    target = torch.randn(b, a, k, v, generator=g)
    return DraftOutput(
        draft_logits=target + 0.7 * torch.randn(b, a, k, v, generator=g),
        target_ids=torch.zeros(b, a, k, dtype=torch.long), eval_mask=eval_mask,
        block_keep_mask=keep, anchor_positions=torch.zeros(b, a, dtype=torch.long),
        prev_token_ids=torch.zeros(b, a, k, dtype=torch.long),
        confidence_logits=torch.randn(b, a, k, generator=g), target_logits=target,
        num_valid_anchors=torch.tensor([5, 0, 7])[:b], seq_len=12,
    )


def _reference(outs: list[DraftOutput], gamma: float) -> dict[str, float]:
    """Plain loops over blocks and slots, straight from the metric definitions."""
    k_ = outs[0].eval_mask.shape[-1]
    num, den = [0.0] * k_, [0.0] * k_
    tau_sum = tau_n = abs_e = bias = cbias = wsum = 0.0
    for out in outs:
        for b in range(out.eval_mask.shape[0]):
            for n in range(out.eval_mask.shape[1]):
                surv_a = surv_c = 1.0
                tau = 1.0
                for k in range(k_):
                    if not out.eval_mask[b, n, k]:
                        surv_a = surv_c = 0.0
                        continue
                    p_d = torch.softmax(out.draft_logits[b, n, k].double(), 0)
                    p_t = torch.softmax(out.target_logits[b, n, k].double(), 0)
                    acc = float(torch.minimum(p_d, p_t).sum())  # = 1 - L1/2
                    conf = 1 / (1 + math.exp(-float(out.confidence_logits[b, n, k])))
                    w = math.exp(-k / gamma)
                    num[k] += acc
                    den[k] += 1
                    surv_a *= acc
                    surv_c *= conf
                    tau += surv_a
                    abs_e += abs(conf - acc) * w
                    bias += (conf - acc) * w
                    cbias += (surv_c - surv_a) * w
                    wsum += w
                if out.block_keep_mask[b, n] and out.eval_mask[b, n].any():
                    tau_sum += tau
                    tau_n += 1
    ref = {f"accept_rate@{k}": num[k] / den[k] for k in range(k_) if den[k]}
    ref |= {"accept_rate": sum(num) / sum(den), "tau": tau_sum / tau_n,
            "confidence_abs_error": abs_e / wsum, "confidence_bias": bias / wsum,
            "confidence_cumprod_bias": cbias / wsum}
    return ref


def _sums(out: DraftOutput, gamma: float = 4.0) -> dict[str, torch.Tensor]:
    loss = compute_dspark_loss(out, LossSpec(loss_decay_gamma=gamma))
    return metric_sums(out, loss.accept_rate, loss.weights)


def test_metrics_match_the_reference() -> None:
    """accept_rate@k, accept_rate, tau and calibration equal the loop reference."""
    out = _output(0)
    got = metric_ratios(_sums(out))
    for key, want in _reference([out], 4.0).items():
        assert got[key] == pytest.approx(want, rel=1e-5, abs=1e-7), key
    assert got["tau"] >= 1.0


def test_window_is_a_ratio_of_sums() -> None:
    """Accumulating two batches then dividing equals the reference over both batches."""
    outs = [_output(1), _output(2)]
    total = None
    for out in outs:
        total = accumulate(total, _sums(out))
    got = metric_ratios(total)
    for key, want in _reference(outs, 4.0).items():
        assert got[key] == pytest.approx(want, rel=1e-5, abs=1e-7), key
    separate = [metric_ratios(_sums(o))["tau"] for o in outs]
    assert got["tau"] != pytest.approx(sum(separate) / 2, rel=1e-9)  # not a mean of means


def test_unmeasured_positions_are_omitted() -> None:
    """Slots no block reaches have no accept_rate@k entry; no teacher gives no accept metrics."""
    out = _output(3)
    out.eval_mask[..., 3:] = False
    got = metric_ratios(_sums(out))
    assert "accept_rate@2" in got
    assert "accept_rate@3" not in got
    assert "accept_rate@4" not in got
    sums = metric_sums(out, None, out.eval_mask.float())
    assert not any(key.startswith("accept_rate") or key == "tau" for key in metric_ratios(sums))


def test_sampler_statistics() -> None:
    """Valid candidates, kept anchors and supervised slots are counted and ratioed."""
    out = _output(4)
    got = metric_ratios(_sums(out))
    assert got["valid_anchors"] == 12
    assert got["valid_anchor_ratio"] == pytest.approx(12 / 33)
    assert got["kept_anchors"] == out.block_keep_mask.sum().item()
    assert got["supervised_slots"] == out.eval_mask.sum().item()
    assert got["supervised_per_block"] == pytest.approx(
        out.eval_mask.sum().item() / out.block_keep_mask.sum().item())
