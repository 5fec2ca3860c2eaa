"""Small qwen3 draft configs for CPU tests and benchmarks."""

from __future__ import annotations

from sparkforge.trainer.architectures.config import DSparkDraftConfig


def draft_tiny(*, vocab_size: int = 256, mask_token_id: int = 3) -> DSparkDraftConfig:
    """A CPU-test draft: H=64, 1 layer, head_dim 16, K=4, 8 anchors, r=16."""
    return DSparkDraftConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=vocab_size, num_hidden_layers=1,
        num_target_layers=4, target_layer_ids=(0, 1, 2), block_size=4, num_anchors=8,
        markov_rank=16, mask_token_id=mask_token_id, rope_parameters={
            "rope_type": "default", "rope_theta": 10_000.0},
    )


def draft_qwen3_small(*, mask_token_id: int = 151_669) -> DSparkDraftConfig:
    """A Qwen3-0.6B-shaped draft (H=1024, 2 layers, V=151_936), used by the CPU benchmark."""
    return DSparkDraftConfig(
        hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151_936, num_hidden_layers=2, num_target_layers=28,
        target_layer_ids=(1, 7, 14, 21, 26), block_size=7, num_anchors=512, markov_rank=256,
        mask_token_id=mask_token_id,
    )
