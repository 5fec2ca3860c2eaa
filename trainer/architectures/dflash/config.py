"""The dflash draft's checks: no Markov or confidence head, and a block of at least two slots."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparkforge.trainer.architectures.config import DSparkDraftConfig


def problems(cfg: DSparkDraftConfig) -> list[str]:
    """A DFlash draft has neither head, and its anchor slot drafts nothing (so K >= 2)."""
    out = []
    if cfg.markov_rank:
        out.append(f"markov_rank={cfg.markov_rank}: a dflash draft has no Markov head (set 0)")
    if cfg.enable_confidence_head or cfg.confidence_head_with_markov:
        out.append("enable_confidence_head / confidence_head_with_markov: a dflash draft "
                   "has no confidence head (set both false)")
    if cfg.block_size < 2:
        out.append(f"block_size={cfg.block_size}: a dflash block drafts block_size - 1 "
                   "tokens, so it needs block_size >= 2")
    return out
