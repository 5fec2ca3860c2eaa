"""A small kimi_k3 draft config for CPU tests."""

from __future__ import annotations

import dataclasses

from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.kimi_k3.config import KimiK3Options
from sparkforge.trainer.architectures.tiny import draft_tiny


def draft_tiny_kimi_k3(*, vocab_size: int = 256, mask_token_id: int = 3) -> DraftConfig:
    """draft_tiny() as a kimi_k3 draft: Q-LoRA 32, latent 16, heads 16 nope + 8 rope, values 16."""
    return dataclasses.replace(
        draft_tiny(vocab_size=vocab_size, mask_token_id=mask_token_id),
        architecture="kimi_k3", num_key_value_heads=4, head_dim=24, options=KimiK3Options(
            q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16))
