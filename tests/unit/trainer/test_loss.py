"""The DSpark loss: each term against a hand computation, chunking, decay, training progress."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from draft_helpers import fixed_anchor_steps, recipe_loss

from sparkforge.trainer.architectures import ARCHITECTURES
from sparkforge.trainer.draft.model import DraftOutput
from sparkforge.trainer.loss import (
    chunked_row_terms,
    compute_dspark_loss,
    decay_weights,
    l1_distance,
)
from sparkforge.trainer.run_config import LossSpec

Build = Callable[..., Any]


def _output(seed: int = 0, b: int = 2, a: int = 3, k: int = 4, v: int = 11,
            conf: bool = True) -> DraftOutput:
    g = torch.Generator().manual_seed(seed)
    eval_mask = torch.cumprod((torch.rand(b, a, k, generator=g) > 0.2).int(), -1).bool()
    return DraftOutput(
        draft_logits=torch.randn(b, a, k, v, generator=g).requires_grad_(),
        target_ids=torch.randint(0, v, (b, a, k), generator=g),
        eval_mask=eval_mask,
        block_keep_mask=eval_mask[..., 0],
        anchor_positions=torch.zeros(b, a, dtype=torch.long),
        prev_token_ids=torch.zeros(b, a, k, dtype=torch.long),
        confidence_logits=torch.randn(b, a, k, generator=g).requires_grad_() if conf else None,
        target_logits=torch.randn(b, a, k, v, generator=g),
        num_valid_anchors=torch.full((b,), a),
        seq_len=20,
    )


def _hand(out: DraftOutput, gamma: float | None) -> tuple[float, float, float, float]:
    """Loop reference: (sum ce*w, sum l1*w, sum bce*w, sum w)."""
    ce = l1 = bce = den = 0.0
    b_, a_, k_, _ = out.draft_logits.shape
    for b in range(b_):
        for n in range(a_):
            for k in range(k_):
                if not out.eval_mask[b, n, k]:
                    continue
                w = math.exp(-k / gamma) if gamma else 1.0
                logits = out.draft_logits[b, n, k].detach().double()
                logp = logits - torch.logsumexp(logits, 0)
                ce += -float(logp[out.target_ids[b, n, k]]) * w
                p_d = torch.softmax(logits, 0)
                p_t = torch.softmax(out.target_logits[b, n, k].double(), 0)
                dist = float(sum(abs(x - y) for x, y in zip(p_d.tolist(), p_t.tolist(),
                                                             strict=True)))
                l1 += dist * w
                c = min(max(1 - dist / 2, 0.0), 1.0)
                s = 1 / (1 + math.exp(-float(out.confidence_logits[b, n, k].detach())))
                bce += -(c * math.log(s) + (1 - c) * math.log(1 - s)) * w
                den += w
    return ce, l1, bce, den


@pytest.mark.parametrize("gamma", [None, 4.0, 0.0])
def test_each_term_matches_a_hand_computation(gamma: float | None) -> None:
    """CE, L1 (full, = 2 TV) and BCE(confidence, 1 - L1/2), decay-weighted, / (sum w + 1e-6)."""
    out = _output()
    ce, l1, bce, den = _hand(out, gamma)
    res = compute_dspark_loss(out, LossSpec(loss_decay_gamma=gamma))
    assert res.ce_loss.item() == pytest.approx(ce / (den + 1e-6), rel=1e-5)
    assert res.l1_loss.item() == pytest.approx(l1 / (den + 1e-6), rel=1e-5)
    assert res.confidence_loss.item() == pytest.approx(bce / (den + 1e-6), rel=1e-5)
    total = (0.1 * ce + 0.9 * l1 + bce) / (den + 1e-6)
    assert res.loss.item() == pytest.approx(total, rel=1e-5)
    assert res.logged_loss.item() == pytest.approx(total, rel=1e-5)


def test_ce_only_is_the_masked_mean() -> None:
    """gamma=None, ce only: loss = sum ce / (sum mask + 1e-6); no teacher needed."""
    out = _output(conf=False)
    out.target_logits = None
    flat = out.eval_mask.flatten()
    ce = F.cross_entropy(out.draft_logits.detach().reshape(-1, 11)[flat],
                         out.target_ids.flatten()[flat], reduction="sum")
    spec = LossSpec(ce_loss_alpha=1.0, l1_loss_alpha=0.0, loss_decay_gamma=None)
    res = compute_dspark_loss(out, spec)
    assert res.loss.item() == pytest.approx(ce.item() / (flat.sum().item() + 1e-6), rel=1e-6)


def test_decay_weights() -> None:
    """w = eval_mask * exp(-k/gamma), k 0-indexed; gamma None or <= 0 -> eval_mask."""
    mask = torch.tensor([[[1, 1, 1, 0]]]).bool()
    torch.testing.assert_close(decay_weights(mask, 2.0),
                               torch.tensor([[[1.0, math.exp(-0.5), math.exp(-1.0), 0.0]]]))
    assert torch.equal(decay_weights(mask, None), mask.float())
    assert torch.equal(decay_weights(mask, -1.0), mask.float())


def test_l1_is_zero_when_draft_equals_teacher() -> None:
    """Draft == teacher gives L1 0 and acceptance 1 on every supervised slot."""
    out = _output()
    out.draft_logits = out.target_logits.clone().requires_grad_()
    res = compute_dspark_loss(out, LossSpec())
    assert res.l1_loss.item() == pytest.approx(0.0, abs=1e-6)
    assert torch.allclose(res.accept_rate[out.eval_mask], torch.tensor(1.0))


def test_chunked_l1_equals_unchunked_in_value_and_gradient() -> None:
    """chunk_rows=2 (checkpointed) equals the plain unchunked computation, value and grad."""
    g = torch.Generator().manual_seed(0)
    draft = torch.randn(7, 13, generator=g, requires_grad=True)
    teacher = torch.randn(7, 13, generator=g)
    ids = torch.randint(0, 13, (7,), generator=g)
    w = torch.rand(7, generator=g)
    ce_c, l1_c = chunked_row_terms(draft, teacher, ids, 2)
    ((ce_c + l1_c) * w).sum().backward()
    grad_c = draft.grad.clone()
    draft.grad = None
    ref_l1 = l1_distance(draft, teacher)
    ref_ce = F.cross_entropy(draft, ids, reduction="none")
    ((ref_ce + ref_l1) * w).sum().backward()
    torch.testing.assert_close(l1_c, ref_l1, rtol=0, atol=1e-6)
    torch.testing.assert_close(ce_c, ref_ce, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_c, draft.grad, rtol=0, atol=1e-7)


def test_loss_chunk_size_does_not_change_loss_or_grads(build: Build) -> None:
    """The full loss with chunk_rows 2 and 10_000 gives the same value and gradients."""
    grads = []
    for chunk in (2, 10_000):
        model, batch = build(seed=2)
        torch.manual_seed(0)
        res = compute_dspark_loss(model(batch), LossSpec(l1_chunk_rows=chunk))
        res.loss.backward()
        grads.append((res.loss.detach(), model.fc.weight.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])


@pytest.mark.parametrize(("conf", "l1_alpha"), [(True, 0.9), (False, 0.9), (True, 0.0)])
def test_teacher_required_for_l1_or_confidence(conf: bool, l1_alpha: float) -> None:
    """A missing teacher with l1_alpha > 0 or a confidence head is a ValueError."""
    out = _output(conf=conf)
    out.target_logits = None
    with pytest.raises(ValueError, match="target_last_hidden_states"):
        compute_dspark_loss(out, LossSpec(l1_loss_alpha=l1_alpha))


def test_confidence_label_is_detached_and_head_not() -> None:
    """BCE grads reach the confidence logits; the label c* carries no gradient to the draft."""
    out = _output()
    compute_dspark_loss(out, LossSpec(ce_loss_alpha=0.0, l1_loss_alpha=0.0)).loss.backward()
    assert out.confidence_logits.grad.abs().sum() > 0
    assert out.draft_logits.grad is None or out.draft_logits.grad.abs().sum() == 0


@pytest.mark.slow
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_loss_decreases_on_a_fixed_batch(build: Build, architecture: str) -> None:
    """20 AdamW steps at lr 5e-3 with fixed anchors lower the loss of each architecture's
    recipe (``recipe_loss``)."""
    model, batch = build(seed=1, architecture=architecture)
    torch.manual_seed(0)
    losses, _ = fixed_anchor_steps(model, batch, recipe_loss(model.config), 20)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.8 * losses[0]
