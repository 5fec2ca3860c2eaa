"""Anchor candidates and sampling, the eval-mask prefix rule, and the block attention rule."""

from __future__ import annotations

import torch

from sparkforge.trainer.draft.anchors import anchor_candidates, build_eval_mask, sample_anchors
from sparkforge.trainer.draft.attention_mask import dense_allowed


def test_candidates_need_two_consecutive_supervised_tokens() -> None:
    """[1,1,0,1,1,1] -> [T,F,F,T,T]."""
    got = anchor_candidates(torch.tensor([[1, 1, 0, 1, 1, 1]]))
    assert got.tolist() == [[True, False, False, True, True]]


def test_sampled_anchors_valid_sorted_unique_and_counted() -> None:
    """Kept anchors are valid, sorted, unique; keep count = min(valid, A); dummies sit at 0."""
    g = torch.Generator().manual_seed(0)
    loss_mask = (torch.rand(6, 40, generator=g) > 0.3).float()
    for num_anchors in (3, 64):
        anchors, keep = sample_anchors(loss_mask, num_anchors, generator=g)
        valid = anchor_candidates(loss_mask)
        for b in range(6):
            kept = anchors[b][keep[b]].tolist()
            assert kept == sorted(set(kept))
            assert all(valid[b, a] for a in kept)
            assert len(kept) == min(int(valid[b].sum()), num_anchors)
            assert keep[b].tolist() == sorted(keep[b].tolist(), reverse=True)
            assert (anchors[b][~keep[b]] == 0).all()


def test_no_valid_candidate_gives_all_dummies() -> None:
    """Without a valid candidate all keep flags are False and no error is raised."""
    anchors, keep = sample_anchors(torch.tensor([[1, 0, 1, 0, 1.0]]), 4)
    assert not keep.any()
    assert (anchors == 0).all()
    assert anchors.shape == (1, 4)


def test_sampling_is_uniform_over_valid_candidates() -> None:
    """Each valid candidate is picked with probability A / #valid (without replacement)."""
    g = torch.Generator().manual_seed(1)
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1.0]])  # 6 valid candidates
    counts = torch.zeros(9)
    trials = 3000
    for _ in range(trials):
        anchors, keep = sample_anchors(loss_mask, 2, generator=g)
        counts[anchors[keep]] += 1
    valid = anchor_candidates(loss_mask)[0]
    assert (counts[~valid] == 0).all()
    freq = counts[valid] / trials
    assert torch.allclose(freq, torch.full_like(freq, 2 / 6), atol=0.04)


def _eval_mask_reference(loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                         k: int) -> torch.Tensor:
    b_, a_ = anchors.shape
    s = loss_mask.shape[1]
    out = torch.zeros(b_, a_, k, dtype=torch.bool)
    for b in range(b_):
        for n in range(a_):
            for j in range(k):
                lab = int(anchors[b, n]) + j + 1
                ok = bool(keep[b, n]) and lab < s and loss_mask[b, lab] > 0.5
                out[b, n, j] = ok and (j == 0 or bool(out[b, n, j - 1]))
    return out


def test_eval_mask_is_the_supervised_prefix() -> None:
    """eval_mask = cumprod(in range & label supervised & kept), against a loop reference."""
    g = torch.Generator().manual_seed(2)
    loss_mask = (torch.rand(4, 30, generator=g) > 0.25).float()
    anchors, keep = sample_anchors(loss_mask, 10, generator=g)
    got = build_eval_mask(loss_mask, anchors, keep, 5)
    assert torch.equal(got, _eval_mask_reference(loss_mask, anchors, keep, 5))
    assert got[keep][:, 0].all()
    assert not got[~keep].any()
    as_int = got.int()
    assert torch.equal(as_int, torch.cumprod(as_int, -1))


def test_attention_rule_against_a_loop_reference() -> None:
    """Context strictly before the anchor, own block bidirectional, no other block, dummies."""
    anchors = torch.tensor([[2, 5, 0], [0, 3, 0]])
    keep = torch.tensor([[True, True, False], [True, True, False]])
    s, k = 8, 3
    got = dense_allowed(anchors, keep, s, k)[:, 0]
    for b in range(2):
        for q in range(3 * k):
            n = q // k
            for kv in range(s + 3 * k):
                if kv < s:
                    want = bool(keep[b, n]) and kv < int(anchors[b, n])
                else:
                    want = (kv - s) // k == n
                assert bool(got[b, q, kv]) == want, (b, q, kv)
    assert got.any(-1).all()  # no all-masked row, dummy blocks included
