"""Test helper: the loss a run trains a draft config with, read from the recipe table."""

from __future__ import annotations

from sparkforge.trainer.architectures.config import DSparkDraftConfig
from sparkforge.trainer.run_config import RECIPES, LossSpec


def recipe_loss(cfg: DSparkDraftConfig) -> LossSpec:
    """The default loss of the recipe whose fixed draft fields ``cfg`` has (dspark's otherwise),
    so a table-driven test trains each tiny draft with its own objective."""
    for recipe in RECIPES.values():
        if recipe.fixed and all(getattr(cfg, name) == recipe.draft_defaults[name]
                                for name in recipe.fixed):
            return LossSpec(objective=recipe.objective)
    return LossSpec(objective="dspark")
