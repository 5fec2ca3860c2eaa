"""Optimizer and schedule: paper defaults, class path, warmup floor, cosine floor."""

from __future__ import annotations

import pytest
import torch

from sparkforge.trainer.schedule import (
    OptimizerConfig,
    SchedulerConfig,
    build_optimizer,
    build_scheduler,
    lr_factor,
)


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3))]


def test_default_optimizer_is_adamw_095() -> None:
    """Defaults follow the recipe: AdamW, lr 6e-4, betas (0.9, 0.95), no weight decay."""
    opt = build_optimizer(_params(), OptimizerConfig())
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (6e-4, (0.9, 0.95), 0.0)


def test_any_optimizer_by_class_path() -> None:
    """A class path selects the optimizer; extra init_args pass through; betas are skipped."""
    opt = build_optimizer(_params(), OptimizerConfig(class_path="torch.optim.SGD", lr=0.1,
                                                     init_args={"momentum": 0.5}))
    assert isinstance(opt, torch.optim.SGD)
    assert opt.param_groups[0]["momentum"] == 0.5


@pytest.mark.parametrize("path", ["torch.optim.Nope", "torch.nn.Linear", "nope"])
def test_bad_class_path_is_refused(path: str) -> None:
    """A path that is not a torch optimizer names the field."""
    with pytest.raises(ValueError, match="optimizer.class_path"):
        build_optimizer(_params(), OptimizerConfig(class_path=path))


@pytest.mark.parametrize(("cfg", "total", "warmup"), [
    (SchedulerConfig(), 100, 20),            # 5% of 100 = 5, floored at 20
    (SchedulerConfig(), 10_000, 500),        # 5% of 10k
    (SchedulerConfig(warmup_steps=0), 100, 0),   # explicit 0 disables the floor
    (SchedulerConfig(warmup_steps=7), 100, 7),
    (SchedulerConfig(), 12, 12),             # never longer than the run
])
def test_warmup_floor(cfg: SchedulerConfig, total: int, warmup: int) -> None:
    """Warmup = ratio x total floored at 20 steps, unless set explicitly."""
    assert cfg.resolve_warmup(total) == warmup


def test_schedule_shape_matches_hand_values() -> None:
    """Linear warmup (step+1)/W, cosine from 1 down to the floor at the last step."""
    f = [lr_factor(s, warmup=4, total=14, min_ratio=0.1) for s in range(15)]
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f[4] == pytest.approx(1.0)
    assert f[9] == pytest.approx(0.1 + 0.9 * 0.5)   # halfway through the decay
    assert f[14] == pytest.approx(0.1)


def test_scheduler_steps_the_optimizer_lr() -> None:
    """The LambdaLR applies the factor to the peak lr step by step."""
    opt = build_optimizer(_params(), OptimizerConfig(lr=1.0))
    sched = build_scheduler(opt, SchedulerConfig(warmup_steps=2, min_lr_ratio=0.0), total_steps=4)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 0.5])


def test_invalid_scheduler_lists_every_field() -> None:
    """All bad scheduler fields are reported together."""
    with pytest.raises(ValueError, match="warmup_steps") as err:
        SchedulerConfig(warmup_steps=-1, min_lr_ratio=2.0)
    assert "min_lr_ratio" in str(err.value)
