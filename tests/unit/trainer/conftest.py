"""Tiny draft configs and random cache-shaped batches for the trainer unit tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sparkforge.trainer.architectures import DRAFT_PAIRS, build_draft, tiny_draft
from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.tiny import draft_tiny
from sparkforge.trainer.draft.block_conv import BlockConv

Batch = dict[str, torch.Tensor]


def make_batch(cfg: DraftConfig, *, batch: int = 2, seq_len: int = 24,
               seed: int = 0) -> Batch:
    """Random ids, a prompt/response loss mask with a hole, features and final states."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)
    loss_mask = torch.ones(batch, seq_len)
    loss_mask[:, :5] = 0
    loss_mask[:, seq_len // 2] = 0
    return {
        "input_ids": ids,
        "loss_mask": loss_mask,
        "target_hidden_states": torch.randn(batch, seq_len, cfg.num_features * cfg.hidden_size,
                                            generator=g),
        "target_last_hidden_states": torch.randn(batch, seq_len, cfg.hidden_size, generator=g),
    }


@pytest.fixture
def tiny_cfg() -> DraftConfig:
    """draft_tiny(): H=64, 1 layer, V=256, K=4, A=8, r=16."""
    return draft_tiny()


PAIR_IDS = [f"{arch}-{layout}" for arch, layout in DRAFT_PAIRS]
"""Test ids of ``DRAFT_PAIRS``, every (architecture, layout) pair a draft trains as."""


def off_identity(model: Any, seed: int = 1) -> Any:
    """``model`` with its block convolutions (DFlash2) moved off their identity init, so a test
    of a fresh draft exercises them; a draft without any is returned as is."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, BlockConv):
                module.base_kernel.copy_(torch.randn(module.base_kernel.shape, generator=g))
                weight = module.kernel_projection.weight
                weight.copy_(0.3 * torch.randn(weight.shape, generator=g))
    return model


def build_tiny(seed: int = 0, attn: str = "sdpa", architecture: str = "qwen3",
               layout: str = "dspark", **overrides: Any) -> tuple[Any, Batch]:
    """A seeded tiny draft of the pair (``tiny_draft``) with field overrides (block convolutions
    off their identity init), and a batch."""
    cfg = dataclasses.replace(tiny_draft(architecture, layout), **overrides)
    torch.manual_seed(seed)
    model = off_identity(build_draft(cfg, attn_implementation=attn))
    return model, make_batch(cfg, seed=seed)


@pytest.fixture
def build() -> Callable[..., tuple[Any, Batch]]:
    """Factory: ``build_tiny`` (draft_tiny() by default)."""
    return build_tiny
