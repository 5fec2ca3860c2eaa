"""Sampling: temperature handling, serial Markov block sampling, lossless rejection sampling."""

from __future__ import annotations

import pytest
import torch

from sparkforge.trainer.draft.heads import MarkovHead
from sparkforge.trainer.draft.sampling import (
    logits_to_probs,
    residual_probs,
    sample_draft_tokens,
)
from sparkforge.trainer.eval.speculative import verify_draft


def test_greedy_is_argmax_one_hot() -> None:
    """T = 0 gives one-hot argmax probabilities; T > 0 probabilities sum to 1."""
    logits = torch.randn(3, 5, 17)
    greedy = logits_to_probs(logits, 0.0)
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1))
    assert torch.equal(greedy.sum(-1),
                                                                             torch.ones(3, 5))
    assert set(greedy.unique().tolist()) == {0.0, 1.0}
    warm = logits_to_probs(logits, 0.7)
    torch.testing.assert_close(warm.sum(-1), torch.ones(3, 5))
    torch.testing.assert_close(warm, torch.softmax(logits / 0.7, -1))


def test_residual_distribution() -> None:
    """Residual = normalize(max(p - q, 0)), shape kept; p itself when p == q."""
    p = torch.softmax(torch.randn(4, 9), -1)
    q = torch.softmax(torch.randn(4, 9), -1)
    res = residual_probs(p, q)
    assert res.shape == (4, 9)
    torch.testing.assert_close(res.sum(-1), torch.ones(4))
    expected = (p - q).clamp(min=0)
    torch.testing.assert_close(res, expected / expected.sum(-1, keepdim=True))
    torch.testing.assert_close(residual_probs(p, p), p)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_serial_markov_sampling(head_type: str) -> None:
    """Tokens [B,K] and logits [B,K,V]; slot k's logits = base_k + bias(d_k) from the head."""
    torch.manual_seed(0)
    b, k, v, h = 2, 5, 13, 8
    head = MarkovHead(v, 4, h, head_type)
    base, hidden = torch.randn(b, k, v), torch.randn(b, k, h)
    first = torch.tensor([1, 2])
    tokens, logits = sample_draft_tokens(base, first, hidden, head, 0.0)
    assert tokens.shape == (b, k)
    assert logits.shape == (b, k, v)
    assert torch.equal(tokens, logits.argmax(-1))
    prev = torch.cat([first[:, None], tokens[:, :-1]], 1)
    torch.testing.assert_close(logits, base + head(prev, hidden))  # teacher-forced = serial
    bias, _ = head.step(first, hidden[:, 0])
    assert bias.shape == (b, v)


def test_sampling_without_markov_head_is_parallel() -> None:
    """Without a head the logits are the base logits and tokens are sampled from them."""
    base = torch.randn(2, 4, 7)
    tokens, logits = sample_draft_tokens(base, torch.tensor([0, 0]), torch.randn(2, 4, 3),
                                         None, 0.0)
    assert torch.equal(logits, base)
    assert torch.equal(tokens, base.argmax(-1))


def test_rejection_sampling_is_lossless_on_a_toy_vocabulary() -> None:
    """Emitted first token ~ p_target whatever the draft law q (TV within sampling noise)."""
    g = torch.Generator().manual_seed(0)
    v, trials = 5, 20_000
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.2, 0.3, 0.2, 0.2]])
    q = torch.tensor([[0.05, 0.05, 0.2, 0.3, 0.4]])
    counts = torch.zeros(v)
    for _ in range(trials):
        d = torch.multinomial(q[0], 1, generator=g)
        n, nxt = verify_draft(d, q, p, g)
        counts[int(d[0]) if n == 1 else nxt] += 1
    tv = 0.5 * (counts / trials - p[0]).abs().sum().item()
    assert tv < 0.015
    assert 0.5 * (q[0] - p[0]).abs().sum().item() > 0.4  # accepting blindly would fail
