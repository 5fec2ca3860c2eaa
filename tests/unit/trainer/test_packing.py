"""Packed rows: each document of a row trains exactly as it would alone (every architecture)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import PAIR_IDS, off_identity
from draft_helpers import recipe_loss

from sparkforge.trainer.architectures import DRAFT_PAIRS, build_draft, tiny_draft
from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.draft.anchors import (
    anchor_candidates,
    document_bounds,
    sample_anchors,
)
from sparkforge.trainer.draft.attention_mask import dense_allowed
from sparkforge.trainer.draft.block_layout import DFLASH_LAYOUT
from sparkforge.trainer.draft.draft_batch import FixedAnchors
from sparkforge.trainer.loss import compute_dspark_loss
from sparkforge.trainer.run_config import LossSpec

Doc = dict[str, torch.Tensor]
DOC_LENGTHS = (13, 9, 17)
PAD = 3


def _docs(cfg: DraftConfig, seed: int = 0) -> list[Doc]:
    """Documents with a prompt (loss 0), a response with a hole, features and final states."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in DOC_LENGTHS:
        mask = torch.ones(n)
        mask[:3] = 0
        mask[n // 2] = 0
        docs.append({"input_ids": torch.randint(0, cfg.vocab_size, (n,), generator=g),
                     "loss_mask": mask,
                     "target_hidden_states": torch.randn(n, cfg.num_features * cfg.hidden_size,
                                                         generator=g),
                     "target_last_hidden_states": torch.randn(n, cfg.hidden_size, generator=g)})
    return docs


def _alone_anchors(model: Any, doc: Doc, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    cand = anchor_candidates(doc["loss_mask"][None], model.layout,
                             block_size=model.config.block_size)
    return sample_anchors(doc["loss_mask"][None], 4, candidates_BC=cand,
                          generator=torch.Generator().manual_seed(seed))


def _packed_row(docs: list[Doc]) -> dict[str, torch.Tensor]:
    """The documents end to end in one row, then PAD padding tokens (as ``collate`` packs)."""
    row: dict[str, torch.Tensor] = {}
    for key in docs[0]:
        parts = [d[key] for d in docs]
        parts.append(torch.zeros((PAD, *parts[0].shape[1:]), dtype=parts[0].dtype))
        row[key] = torch.cat(parts)[None]
    row["attention_mask"] = torch.cat([torch.ones(sum(DOC_LENGTHS)), torch.zeros(PAD)])[None]
    row["position_ids"] = torch.cat([torch.arange(n) for n in DOC_LENGTHS]
                                    + [torch.zeros(PAD, dtype=torch.long)])[None]
    row["document_ids"] = torch.cat([torch.full((n,), i) for i, n in enumerate(DOC_LENGTHS)]
                                    + [torch.full((PAD,), -1)])[None]
    return row


def _summed_objective(out: Any, spec: LossSpec) -> torch.Tensor:
    """The loss numerator sum_t alpha_t sum_slots w term_t (additive over documents)."""
    res = compute_dspark_loss(out, spec)
    return res.loss * (res.global_denominator + 1e-6)


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


FIELDS = ("draft_logits", "target_ids", "eval_mask", "prev_token_ids", "confidence_logits",
          "target_logits")


@pytest.mark.parametrize(("architecture", "layout"), DRAFT_PAIRS, ids=PAIR_IDS)
def test_packed_row_equals_each_document_alone(architecture: str, layout: str) -> None:
    """Same anchors: per-anchor outputs, teacher targets and gradients match the unpacked runs."""
    cfg = tiny_draft(architecture, layout)
    spec = recipe_loss(cfg)
    torch.manual_seed(0)
    model = off_identity(build_draft(cfg, attn_implementation="sdpa"))
    docs = _docs(cfg)
    alone, anchors, keeps, offset = [], [], [], 0
    model.zero_grad()
    for i, doc in enumerate(docs):
        a, keep = _alone_anchors(model, doc, seed=i)
        assert bool(keep.any())
        out = model({k: v[None] for k, v in doc.items()}, FixedAnchors(a, keep))
        _summed_objective(out, spec).backward()
        alone.append(out)
        anchors.append(a + offset)  # a dummy sits on its document's first token, as alone
        keeps.append(keep)
        offset += DOC_LENGTHS[i]
    want_grads = _grads(model)

    model.zero_grad()
    packed = model(_packed_row(docs), FixedAnchors(torch.cat(anchors, 1), torch.cat(keeps, 1)))
    _summed_objective(packed, spec).backward()
    for name in FIELDS:
        got = getattr(packed, name)
        if got is None:
            assert all(getattr(o, name) is None for o in alone), name
            continue
        want = torch.cat([getattr(o, name) for o in alone], 1)
        if got.is_floating_point():
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=name)
        else:
            assert torch.equal(got, want), name
    got_grads = _grads(model)
    assert want_grads
    assert got_grads.keys() == want_grads.keys()
    # A gradient sums over every anchor of the row, in another order packed than alone: its fp32
    # rounding grows with its size, so the bound is 1e-6 of the tensor's largest entry (at least
    # 1e-6). A document that leaks into another changes gradients by orders more.
    for name, want in want_grads.items():
        atol = 1e-6 * max(1.0, float(want.abs().max()))
        torch.testing.assert_close(got_grads[name], want, atol=atol, rtol=1e-5, msg=name)


def test_packed_flex_mask_matches_the_dense_mask() -> None:
    """The flex BlockMask path gives the dense-mask forward on a packed row (eager, CPU)."""
    cfg = tiny_draft("qwen3")
    torch.manual_seed(0)
    sdpa = build_draft(cfg, attn_implementation="sdpa").eval()
    flex = build_draft(cfg, attn_implementation="flex").eval()
    flex.load_state_dict(sdpa.state_dict())
    row = _packed_row(_docs(cfg))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        want = sdpa(row, generator=gen)
        got = flex(row, FixedAnchors(want.anchor_positions, want.block_keep_mask))
    torch.testing.assert_close(got.draft_logits, want.draft_logits, atol=1e-5, rtol=1e-5)


def test_document_bounds() -> None:
    """Start and exclusive end of each position's run."""
    start, end = document_bounds(torch.tensor([[7, 7, 7, 9, 9, -1], [0, 1, 1, 1, 2, 2]]))
    assert start.tolist() == [[0, 0, 0, 3, 3, 5], [0, 1, 1, 1, 4, 4]]
    assert end.tolist() == [[3, 3, 3, 5, 5, 6], [1, 4, 4, 4, 6, 6]]


def test_anchors_never_cross_a_document_end() -> None:
    """DSpark: the first target must be in the anchor's document; DFlash: the whole block."""
    mask = torch.ones(1, 8)
    _, ends = document_bounds(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]))
    assert anchor_candidates(mask, ends_BS=ends).tolist() == [[1, 1, 0, 1, 1, 1, 1]]
    got = anchor_candidates(mask, DFLASH_LAYOUT, block_size=3, ends_BS=ends)
    assert got.tolist() == [[1, 0, 0, 1, 1, 1, 0]]


def test_packed_mask_hides_other_documents() -> None:
    """A block sees context only in [document start, anchor); it always sees its own block."""
    s, k = 8, 2
    anchors, keep = torch.tensor([[2, 6]]), torch.tensor([[True, True]])
    got = dense_allowed(anchors, keep, s, k, starts_BA=torch.tensor([[0, 4]]))[0, 0]
    ctx = got[:, :s].int().tolist()
    assert ctx[:2] == [[1, 1, 0, 0, 0, 0, 0, 0]] * 2
    assert ctx[2:] == [[0, 0, 0, 0, 1, 1, 0, 0]] * 2
    assert got[:, s:].int().tolist() == [[1, 1, 0, 0]] * 2 + [[0, 0, 1, 1]] * 2


def test_a_document_alone_in_a_padded_packed_row_equals_the_unpacked_row() -> None:
    """A one-document packed row (sampled anchors) gives the plain padded row's result."""
    cfg = tiny_draft("qwen3")
    torch.manual_seed(0)
    model = build_draft(cfg).eval()
    doc = _docs(cfg)[2]
    n = doc["input_ids"].shape[0]
    plain = {k: torch.cat([v, torch.zeros((PAD, *v.shape[1:]), dtype=v.dtype)])[None]
             for k, v in doc.items()}
    plain["attention_mask"] = torch.cat([torch.ones(n), torch.zeros(PAD)])[None]
    packed = dict(plain, position_ids=torch.cat([torch.arange(n), torch.zeros(PAD).long()])[None],
                  document_ids=torch.cat([torch.zeros(n), torch.full((PAD,), -1)]).long()[None])
    with torch.no_grad():
        want = model(plain, generator=torch.Generator().manual_seed(3))
        got = model(packed, generator=torch.Generator().manual_seed(3))
    assert torch.equal(got.anchor_positions, want.anchor_positions)
    assert torch.equal(got.eval_mask, want.eval_mask)
    torch.testing.assert_close(got.draft_logits, want.draft_logits, atol=1e-6, rtol=1e-6)
