"""A Qwen3-0.6B-shaped draft config for the CPU benchmark."""

from __future__ import annotations

from sparkforge.trainer.architectures.config import DraftConfig


def draft_qwen3_small(*, mask_token_id: int = 151_669) -> DraftConfig:
    """A Qwen3-0.6B-shaped draft (H=1024, 2 layers, V=151_936), used by the CPU benchmark."""
    return DraftConfig(
        hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151_936, num_hidden_layers=2, num_target_layers=28,
        target_layer_ids=(1, 7, 14, 21, 26), block_size=7, num_anchors=512, markov_rank=256,
        mask_token_id=mask_token_id,
    )
