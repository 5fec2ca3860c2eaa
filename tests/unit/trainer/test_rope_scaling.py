"""The target's RoPE scaling reaches the draft's config, its rotation and its export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rope_targets import MAX_POSITIONS, SCALINGS, draft_config, export, target_json
from transformers import AutoConfig
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_next import modeling_qwen3_next

from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.qwen3.model import Qwen3DraftModel
from sparkforge.trainer.draft.rope import apply_rotary
from sparkforge.trainer.export import ExportError


def transformers_rotation(target: dict[str, Any], x: torch.Tensor,
                          positions: torch.Tensor) -> torch.Tensor:
    """``x [1, N, P, D]`` rotated by the target model's own rotary embedding and apply."""
    data = dict(target)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    module = modeling_qwen3_next if config.model_type == "qwen3_next" else modeling_qwen3
    rotary = (module.Qwen3NextRotaryEmbedding if module is modeling_qwen3_next
              else module.Qwen3RotaryEmbedding)(config)
    cos, sin = rotary(x, positions[None])
    return module.apply_rotary_pos_emb(x, x, cos, sin)[0]


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_draft_rotates_as_the_target_at_long_positions(name: str) -> None:
    """Every position up to max_position_embeddings (past the original length of the scaled
    types) rotates queries and keys exactly as the target's transformers module does."""
    target = target_json(name)
    cfg = draft_config(target)
    model = Qwen3DraftModel(cfg)
    positions = torch.arange(MAX_POSITIONS)
    x = torch.randn(1, cfg.num_attention_heads, MAX_POSITIONS, cfg.head_dim,
                    generator=torch.Generator().manual_seed(0))
    cos, sin = model.rotary_emb(positions[None], torch.float32)
    want = transformers_rotation(target, x, positions)
    torch.testing.assert_close(apply_rotary(x, cos, sin), want, atol=2e-5, rtol=1e-5)
    if SCALINGS[name]:  # a scaled (or partial) rotation differs from the plain one
        plain = Qwen3DraftModel(draft_config(target_json("default"))).rotary_emb
        assert not torch.allclose(apply_rotary(x, *plain(positions[None], torch.float32)), want,
                                  atol=1e-3)


@pytest.mark.parametrize("name", ["yarn", "partial"])
def test_export_carries_the_target_rope(name: str, tmp_path: Path) -> None:
    """The served config.json holds the target's RoPE settings and length, as transformers
    standardises them."""
    target = target_json(name)
    config = json.loads((export(draft_config(target), tmp_path / "d") / "config.json")
                        .read_text())
    data = dict(target)
    hf = AutoConfig.for_model(data.pop("model_type"), **data)
    assert config["rope_parameters"] == dict(hf.rope_parameters)
    assert config["max_position_embeddings"] == MAX_POSITIONS


@pytest.mark.parametrize(("rope", "why"), [
    ({"rope_type": "dynamic", "factor": 2.0}, "one NTK table"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
      "original_max_position_embeddings": 128}, "short or the long factors"),
])
def test_export_refuses_a_rope_the_engine_serves_otherwise(rope: dict[str, Any], why: str,
                                                           tmp_path: Path) -> None:
    """A RoPE type vLLM builds differently from the draft's training table is refused by name."""
    cfg = draft_config(target_json("default"))
    cfg = DraftConfig.from_dict({**cfg.to_dict(),
                                       "rope_parameters": {"rope_theta": 50_000.0, **rope}})
    with pytest.raises(ExportError, match=f"rope_type='{rope['rope_type']}'.*{why}"):
        export(cfg, tmp_path / "d")
    assert not (tmp_path / "d").exists()
