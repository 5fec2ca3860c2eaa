"""A small gemma4 draft config for CPU tests."""

from __future__ import annotations

import dataclasses

from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.tiny import draft_tiny


def draft_tiny_gemma4(*, vocab_size: int = 256, mask_token_id: int = 3) -> DraftConfig:
    """draft_tiny() as a gemma4 draft, with a Gemma-style sqrt(H) embedding scale (8)."""
    return dataclasses.replace(draft_tiny(vocab_size=vocab_size, mask_token_id=mask_token_id),
                               architecture="gemma4", embedding_scale=8.0)
