"""A small deepseek_v4 draft config for CPU tests."""

from __future__ import annotations

import dataclasses

from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.deepseek_v4.config import DeepseekV4Options
from sparkforge.trainer.architectures.tiny import draft_tiny


def draft_tiny_deepseek_v4(*, vocab_size: int = 256, mask_token_id: int = 3) -> DraftConfig:
    """draft_tiny() as a deepseek_v4 draft: one K=V latent, Q-LoRA 32, 2 output groups, RoPE 8."""
    return dataclasses.replace(
        draft_tiny(vocab_size=vocab_size, mask_token_id=mask_token_id),
        architecture="deepseek_v4", num_key_value_heads=1, options=DeepseekV4Options(
            q_lora_rank=32, o_lora_rank=16, o_groups=2, qk_rope_head_dim=8, swiglu_limit=10.0))
