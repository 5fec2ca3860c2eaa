"""eval's lm_head check: the same head at bf16 export precision passes, another head does not."""

from __future__ import annotations

import torch

from sparkforge.trainer.eval.run import _same_head


def test_bf16_export_of_the_target_head_is_the_same_head() -> None:
    """An fp32 target head equals its own bf16-rounded export; a changed entry does not."""
    target = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    exported = target.bfloat16().float()
    assert not torch.equal(target, exported)   # rounding did change it
    assert _same_head(target, exported)
    other = exported.clone()
    other[3, 2] += 1.0
    assert not _same_head(target, other)


def test_full_precision_draft_head_is_compared_exactly() -> None:
    """A draft head kept in fp32 must equal the target bit for bit."""
    target = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    assert _same_head(target, target.clone())
    assert not _same_head(target, target + 1e-6)
