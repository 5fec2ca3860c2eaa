"""The tiny draft config every architecture's CPU-test config starts from."""

from __future__ import annotations

from sparkforge.trainer.architectures.config import DraftConfig


def draft_tiny(*, vocab_size: int = 256, mask_token_id: int = 3) -> DraftConfig:
    """A CPU-test draft: H=64, 1 layer, head_dim 16, K=4, 8 anchors, r=16 (qwen3, dspark)."""
    return DraftConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=vocab_size, num_hidden_layers=1,
        num_target_layers=4, target_layer_ids=(0, 1, 2), block_size=4, num_anchors=8,
        markov_rank=16, mask_token_id=mask_token_id, rope_parameters={
            "rope_type": "default", "rope_theta": 10_000.0},
    )
