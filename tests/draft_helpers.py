"""Test helpers: the loss a run trains a draft config with (read from the recipe table), and
the training steps on a fixed batch that the loss-decrease tests take."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.run_config import RECIPES, LossSpec


def recipe_loss(cfg: DraftConfig) -> LossSpec:
    """The loss of the recipe that trains ``cfg``'s block layout (DSpark's three terms, DFlash's
    CE), so a table-driven test trains each tiny draft with its own objective."""
    (objective,) = {r.objective for r in RECIPES.values()
                    if r.draft_defaults["layout"] == cfg.layout}
    return LossSpec(objective=objective)


def fixed_anchor_steps(model: Any, batch: Mapping[str, Any], spec: LossSpec, steps: int, *,
                       autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
                       ) -> tuple[list[float], Any]:
    """``steps`` AdamW steps (lr 5e-3) on one batch with the anchors its first forward draws:
    the losses, and those anchors."""
    from sparkforge.trainer.draft.draft_batch import FixedAnchors
    from sparkforge.trainer.loss import compute_dspark_loss

    with autocast():
        first = model(batch)
    anchors = FixedAnchors(first.anchor_positions, first.block_keep_mask)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    losses = []
    for _ in range(steps):
        with autocast():
            loss = compute_dspark_loss(model(batch, anchors), spec).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, anchors
