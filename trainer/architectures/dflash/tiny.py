"""A small dflash draft config for CPU tests."""

from __future__ import annotations

import dataclasses

from sparkforge.trainer.architectures.config import DSparkDraftConfig
from sparkforge.trainer.architectures.qwen3.tiny import draft_tiny


def draft_tiny_dflash(*, vocab_size: int = 256, mask_token_id: int = 3) -> DSparkDraftConfig:
    """draft_tiny() as a dflash draft: no Markov or confidence head."""
    return dataclasses.replace(draft_tiny(vocab_size=vocab_size, mask_token_id=mask_token_id),
                               architecture="dflash", markov_rank=0, enable_confidence_head=False,
                               confidence_head_with_markov=False)
