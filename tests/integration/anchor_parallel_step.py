"""Test helper: the anchor-parallel training step of a tiny draft, as each rank runs it."""

from __future__ import annotations

import torch

from sparkforge.trainer.architectures import build_draft, tiny_draft
from sparkforge.trainer.draft.anchors import anchor_candidates, sample_anchors
from sparkforge.trainer.draft.draft_batch import FixedAnchors
from sparkforge.trainer.loss import compute_dspark_loss
from sparkforge.trainer.run_config import LossSpec

SEQ_LEN = 48


def build() -> torch.nn.Module:
    """The seeded tiny qwen3 draft with 12 anchors per row."""
    import dataclasses

    torch.manual_seed(0)
    return build_draft(dataclasses.replace(tiny_draft("qwen3", "dspark"), num_anchors=12))


def row() -> dict[str, torch.Tensor]:
    """One seeded row: a prompt of 6 tokens, then a reply, with features and final states."""
    cfg = tiny_draft("qwen3", "dspark")
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, cfg.vocab_size, (1, SEQ_LEN), generator=g),
            "loss_mask": (torch.arange(SEQ_LEN) >= 6).float()[None],
            "target_hidden_states": torch.randn(1, SEQ_LEN, cfg.num_features * cfg.hidden_size,
                                                generator=g),
            "target_last_hidden_states": torch.randn(1, SEQ_LEN, cfg.hidden_size, generator=g)}


def anchor_shard(model: torch.nn.Module, batch: dict[str, torch.Tensor], rank: int,
                 world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's anchors (drawn alike on every rank) and this rank's share: every world-th."""
    cfg = model.config  # type: ignore[union-attr]
    cand = anchor_candidates(batch["loss_mask"], model.layout,  # type: ignore[arg-type]
                             block_size=cfg.block_size)
    anchors, keep = sample_anchors(batch["loss_mask"], cfg.num_anchors, candidates_BC=cand,
                                   generator=torch.Generator().manual_seed(2))
    return anchors[:, rank::world], keep[:, rank::world]


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor], anchors: torch.Tensor,
         keep: torch.Tensor) -> torch.Tensor:
    """Forward and backward of the DSpark loss over the given anchors; returns the detached
    loss numerator (the loss times its global denominator, additive over anchors)."""
    model.zero_grad()
    res = compute_dspark_loss(model(batch, FixedAnchors(anchors, keep)),
                              LossSpec())
    res.loss.backward()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return (res.loss.detach() * (res.global_denominator + 1e-6) / world).reshape(1)
