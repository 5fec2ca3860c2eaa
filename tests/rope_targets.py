"""Test helper: tiny target configs with each RoPE scaling, and the drafts built from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.qwen3.model import Qwen3DraftModel
from sparkforge.trainer.export import export_draft
from sparkforge.trainer.run_config import DraftSpec

MAX_POSITIONS = 512
# config.json spellings as checkpoints ship them: the legacy rope_scaling dict with rope_theta.
SCALINGS: dict[str, dict[str, Any]] = {
    "yarn": {"rope_scaling": {"type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 128}},
    "yarn_attention_factor": {"rope_scaling": {"rope_type": "yarn", "factor": 8.0,
                                               "original_max_position_embeddings": 64,
                                               "attention_factor": 0.8, "beta_fast": 16}},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "default": {},
    "partial": {"model_type": "qwen3_next", "partial_rotary_factor": 0.25},
}


def target_json(name: str) -> dict[str, Any]:
    """A tiny target ``config.json`` with the named RoPE settings."""
    extra = dict(SCALINGS[name])
    return {"model_type": extra.pop("model_type", "qwen3"), "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "intermediate_size": 96, "num_hidden_layers": 4, "vocab_size": 300,
            "rope_theta": 50_000.0, "max_position_embeddings": MAX_POSITIONS, **extra}


def draft_config(target: dict[str, Any]) -> DraftConfig:
    """The draft config the trainer builds from the cache's target config."""
    spec = DraftSpec(mask_token_id=3, hidden_size=64, vocab_size=300, num_target_layers=4,
                     target_layer_ids=(0, 2), num_hidden_layers=1, block_size=4, num_anchors=8,
                     markov_rank=8)
    return spec.draft_config(target)


def export(cfg: DraftConfig, out: Path) -> Path:
    """The seeded draft of ``cfg`` exported to ``out``."""
    torch.manual_seed(0)
    return export_draft(cfg, Qwen3DraftModel(cfg).state_dict(), out)
