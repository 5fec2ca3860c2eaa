"""Tiny draft configs and random cache-shaped batches for the trainer unit tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sparkforge.trainer.architectures import build_draft
from sparkforge.trainer.draft.config import (
    DSparkDraftConfig,
    draft_tiny,
    draft_tiny_deepseek_v4,
    draft_tiny_kimi_k3,
)

Batch = dict[str, torch.Tensor]


def make_batch(cfg: DSparkDraftConfig, *, batch: int = 2, seq_len: int = 24,
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
def tiny_cfg() -> DSparkDraftConfig:
    """draft_tiny(): H=64, 1 layer, V=256, K=4, A=8, r=16."""
    return draft_tiny()


TINY_DRAFTS: dict[str, Callable[[], DSparkDraftConfig]] = {
    "qwen3": draft_tiny, "deepseek_v4": draft_tiny_deepseek_v4,
    "gemma4": lambda: dataclasses.replace(draft_tiny(), architecture="gemma4",
                                          embedding_scale=8.0),
    "kimi_k3": draft_tiny_kimi_k3}
"""The tiny config of each draft architecture."""


@pytest.fixture
def build() -> Callable[..., tuple[Any, Batch]]:
    """Factory: a seeded tiny draft (draft_tiny() by default) with field overrides, and a batch."""

    def _build(seed: int = 0, attn: str = "sdpa", architecture: str = "qwen3",
               **overrides: Any) -> tuple[Any, Batch]:
        cfg = dataclasses.replace(TINY_DRAFTS[architecture](), **overrides)
        torch.manual_seed(seed)
        return build_draft(cfg, attn_implementation=attn), make_batch(cfg, seed=seed)

    return _build
