"""Anchor-chunked SDPA: the dense mask's forward and gradients, one chunk's grid at a time."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import build_tiny
from draft_helpers import recipe_loss

from sparkforge.trainer.architectures import DRAFT_PAIRS
from sparkforge.trainer.draft import anchor_chunks
from sparkforge.trainer.draft.anchor_chunks import anchor_chunk_size, dense_grid
from sparkforge.trainer.draft.draft_batch import FixedAnchors
from sparkforge.trainer.loss import compute_dspark_loss

FIELDS = ("draft_logits", "target_logits", "confidence_logits", "eval_mask", "target_ids")


def _packed(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch's rows as two documents each (split at 10), with per-document positions."""
    b, s = batch["input_ids"].shape
    doc = (torch.arange(s) >= 10).long().expand(b, s)
    pos = torch.where(doc == 0, torch.arange(s), torch.arange(s) - 10)
    return {**batch, "document_ids": doc.contiguous(), "position_ids": pos.contiguous()}


def _step(model: Any, batch: dict[str, torch.Tensor], anchors: torch.Tensor,
          keep: torch.Tensor) -> tuple[Any, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = model(batch, FixedAnchors(anchors, keep))
    compute_dspark_loss(out, recipe_loss(model.config)).loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = [(arch, layout, True) for arch, layout in DRAFT_PAIRS] + [("qwen3", "dspark", False)]


@pytest.mark.parametrize(("architecture", "layout", "packed"), CASES,
                         ids=[f"{a}-{lay}-{'packed' if p else 'plain'}" for a, lay, p in CASES])
def test_chunked_forward_and_gradients_equal_the_dense_mask(
        architecture: str, layout: str, packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 3 anchors (unsorted, with dummies) give the dense run's outputs and gradients,
    for every architecture in each layout on packed rows (documents start past position 0)."""
    model, batch = build_tiny(architecture=architecture, layout=layout, num_anchors=8)
    if packed:
        batch = _packed(batch)
    k = model.config.block_size
    # Unsorted anchors with two dummies (position 0, keep False) in the middle of a chunk.
    anchors = torch.tensor([[14, 5, 0, 0, 20, 7, 11, 17], [6, 19, 8, 13, 0, 15, 9, 12]])
    keep = anchors > 0
    want, want_grads = _step(model, batch, anchors, keep)
    monkeypatch.setattr(anchor_chunks, "DENSE_GRID_LIMIT", dense_grid(3, k, 24))
    assert anchor_chunk_size(8, k, 24) == 3
    got, got_grads = _step(model, batch, anchors, keep)
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        if a is None:
            assert b is None, name
        elif a.is_floating_point():
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)
        else:
            assert torch.equal(a, b), name
    assert want_grads
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        atol = 1e-6 * max(1.0, float(grad.abs().max()))
        torch.testing.assert_close(got_grads[name], grad, atol=atol, rtol=1e-5, msg=name)


def test_no_mask_holds_more_than_a_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the limit, every dense mask built covers one chunk's queries and the context its
    anchors see (the sorted anchors' last one bounds it), never the whole row's grid."""
    model, batch = build_tiny(num_anchors=8)
    k = model.config.block_size
    seen: list[tuple[int, ...]] = []
    real = anchor_chunks.dense_allowed

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        mask = real(*args, **kwargs)
        seen.append(tuple(mask.shape))
        return mask

    monkeypatch.setattr(anchor_chunks, "dense_allowed", recording)
    monkeypatch.setattr(anchor_chunks, "DENSE_GRID_LIMIT", dense_grid(2, k, 24))
    anchors = torch.tensor([[5, 6, 7, 8, 12, 13, 20, 21]] * 2)
    out = model(batch, FixedAnchors(anchors, anchors > 0))
    out.draft_logits.sum().backward()
    forward = seen[: len(seen) // 2]   # the backward pass recomputes each chunk once
    assert [s[2:] for s in forward] == [(2 * k, 6 + 2 * k), (2 * k, 8 + 2 * k),
                                        (2 * k, 13 + 2 * k), (2 * k, 21 + 2 * k)]
    assert seen[len(seen) // 2:] == forward[::-1]


def test_chunk_size_fits_the_limit() -> None:
    """Chunks take the most anchors whose grid over the whole context fits, at least one."""
    assert anchor_chunk_size(32, 7, 576) is None   # the code target's rows: one dense mask
    chunk = anchor_chunk_size(512, 7, 32_768)
    assert chunk is not None
    assert dense_grid(chunk, 7, 32_768) <= anchor_chunks.DENSE_GRID_LIMIT
    assert dense_grid(chunk + 1, 7, 32_768) > anchor_chunks.DENSE_GRID_LIMIT
    assert anchor_chunk_size(512, 7, 1 << 22) == 1
