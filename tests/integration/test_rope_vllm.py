"""vLLM's RoPE for an exported draft's config.json rotates as the draft trained, far out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rope_targets import MAX_POSITIONS, draft_config, export, target_json

pytestmark = pytest.mark.slow

# The scaled types the unit test checks against transformers, and partial rotary (Qwen3-Next).
NAMES = ("yarn", "yarn_attention_factor", "linear", "llama3", "partial", "default")


def test_vllm_tables_equal_the_drafts(tmp_path: Path) -> None:
    """For each RoPE setting, vLLM's ``get_rope`` over the exported config (what it builds
    the served draft's attention with) rotates queries as the draft's training does, at every
    position up to max_position_embeddings."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from sparkforge.trainer.architectures.qwen3.model import Qwen3DraftModel
    from sparkforge.trainer.draft.rope import apply_rotary

    positions = torch.arange(MAX_POSITIONS)
    for name in NAMES:
        cfg = draft_config(target_json(name))
        served = json.loads((export(cfg, tmp_path / name) / "config.json").read_text())
        heads, head_dim = served["num_attention_heads"], served["head_dim"]
        q = torch.randn(MAX_POSITIONS, heads, head_dim, generator=torch.Generator().manual_seed(0))
        with set_current_vllm_config(VllmConfig()):
            rope = get_rope(head_dim, served["max_position_embeddings"], True,
                            served["rope_parameters"], torch.float32)
        got, _ = rope.forward_native(positions, q.flatten(1).clone(), None)
        cos, sin = Qwen3DraftModel(cfg).rotary_emb(positions[None], torch.float32)
        want = apply_rotary(q.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
        torch.testing.assert_close(got.view_as(q), want, atol=2e-5, rtol=1e-5, msg=name)
