"""Optimizer and lr schedule of the paper recipe: AdamW (0.9, 0.95), warmup, cosine to a floor."""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from sparkforge.shared.errors import SparkforgeError

logger = logging.getLogger(__name__)

MIN_WARMUP_STEPS = 20


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Any ``torch.optim.Optimizer`` by class path, with the recipe's defaults."""

    class_path: str = "torch.optim.AdamW"
    """Import path of the optimizer class (e.g. torch.optim.SGD, torch.optim.Adam)."""
    lr: float = 6e-4
    """Peak learning rate (6e-4: the published DSpark recipe)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas; passed only to optimizers that accept them."""
    weight_decay: float = 0.0
    """Decoupled weight decay (0 in the recipe)."""
    init_args: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the optimizer (e.g. {"momentum": 0.9} for SGD)."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` of the peak; one step per update."""

    warmup_steps: int | None = None
    """Explicit warmup length; 0 disables warmup. None: ``warmup_ratio`` of the run, at least 20."""
    warmup_ratio: float = 0.05
    """Warmup as a fraction of total_steps when warmup_steps is None."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine as a fraction of the peak lr."""
    total_steps: int | None = None
    """Optimizer steps of the run; None: taken from the trainer (max_steps or epochs x batches)."""

    def __post_init__(self) -> None:
        problems = []
        if self.warmup_steps is not None and self.warmup_steps < 0:
            problems.append(f"model.scheduler.warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.warmup_ratio < 1.0:
            problems.append(f"model.scheduler.warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            problems.append(f"model.scheduler.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.total_steps is not None and self.total_steps < 1:
            problems.append(f"model.scheduler.total_steps={self.total_steps} must be >= 1")
        if problems:
            raise SparkforgeError("invalid scheduler config:\n  " + "\n  ".join(problems))

    def resolve_warmup(self, total_steps: int) -> int:
        """Warmup steps: explicit value, else ratio x total floored at 20 (never past the run)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return min(max(MIN_WARMUP_STEPS, math.ceil(self.warmup_ratio * total_steps)), total_steps)


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def optimizer_class(class_path: str) -> type[torch.optim.Optimizer]:
    """Import ``class_path`` and check it is a torch optimizer."""
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise SparkforgeError(
            f"model.optimizer.class_path={class_path!r} cannot be imported") from exc
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise SparkforgeError(
            f"model.optimizer.class_path={class_path!r} is not a torch.optim.Optimizer"
        )
    return cls


def build_optimizer(params: Iterable[torch.nn.Parameter],
                    cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """Instantiate the configured optimizer over the trainable ``params``."""
    cls = optimizer_class(cfg.class_path)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs: dict[str, Any] = {"lr": cfg.lr}
    for name, value in (("betas", tuple(cfg.betas)), ("weight_decay", cfg.weight_decay)):
        if name in accepted:
            kwargs[name] = value
        elif name == "betas" or value:
            logger.warning("optimizer %s takes no %r; ignoring optimizer.%s", cfg.class_path,
                           name, name)
    return cls(list(params), **{**kwargs, **cfg.init_args})


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, *, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + cosine ``LambdaLR`` over ``total_steps`` optimizer steps."""
    total = cfg.total_steps or total_steps
    warmup = cfg.resolve_warmup(total)
    logger.info("lr schedule: %d warmup steps, cosine to %.3g x peak over %d steps",
                warmup, cfg.min_lr_ratio, total)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, warmup=warmup, total=total, min_ratio=cfg.min_lr_ratio),
    )
