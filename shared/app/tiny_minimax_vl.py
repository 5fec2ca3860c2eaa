"""Build a tiny random MiniMax-M3 VL target offline, for demos and tests.

The ``minimax_m3_vl`` top level (``MiniMaxM3SparseForConditionalGeneration``) around a tiny
``minimax_m3_vl_text`` model (H=64, head_dim 32, 4 experts, sigmoid routing, a block-sparse
indexer), with a one-layer vision tower. With images it also gets MiniMax's image tokens, a chat
template that renders image parts and a ``preprocessor_config.json`` matching the tower, so image
rows are captured with their pixels (``sparkforge.shared.minimax_vl_pixels``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sparkforge.app.tiny_text import SPECIAL_TOKENS, build_tokenizer

MINIMAX_IMAGE_TOKENS = ("]<]start of image[>[", "]<]end of image[>[", "]<]image[>[")
"""MiniMax-M3 VL's begin-of-image, end-of-image and image tokens (``MiniMaxM3VLProcessor``);
the tokenizer gives them ids 4, 5, 6."""
MINIMAX_PIXELS = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
                  "min_pixels": 16 * 16, "max_pixels": 48 * 48}
"""The tiny MiniMax-M3 VL's ``preprocessor_config.json`` (matching its vision tower)."""
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4,
          "image_size": 16}
"""The one-layer vision tower."""


def minimax_text_settings(num_hidden_layers: int = 4) -> dict[str, Any]:
    """Config values of the tiny ``minimax_m3_vl_text`` model: the first layer dense, the
    others sparse MoE, all full attention with the block indexer."""
    return {
        "hidden_size": 64, "num_hidden_layers": num_hidden_layers, "vocab_size": 1024,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 128, "max_position_embeddings": 4096, "initializer_range": 0.08,
        "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": None,
        "eos_token_id": 2, "index_n_heads": 2, "index_head_dim": 16, "num_local_experts": 4,
        "num_experts_per_tok": 2, "rotary_dim": 8, "dense_intermediate_size": 128,
        "shared_intermediate_size": 32, "index_block_size": 4, "index_topk_blocks": 2,
        "index_local_blocks": 1,
        "mlp_layer_types": ["dense"] + ["sparse"] * (num_hidden_layers - 1),
        "layer_types": ["full_attention"] * num_hidden_layers,
    }


def pinned_config(model_type: str, settings: Mapping[str, Any]) -> Any:
    """The transformers config of ``model_type`` with ``settings`` re-applied after init (some
    ``__init__``s derive these; pin them)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **settings)
    for key, value in settings.items():
        setattr(config, key, value)
    return config


def build_tiny_minimax_vl(out_dir: str | Path, *, num_hidden_layers: int = 4, seed: int = 0,
                          images: bool = True) -> Path:
    """Write a tiny random MiniMax-M3 VL (fp32, eager attention) + tokenizer to ``out_dir``;
    ``images`` adds its image tokens, image template and processor config."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = pinned_config("minimax_m3_vl_text", minimax_text_settings(num_hidden_layers))
    build_tokenizer(out, vocab_size=text.vocab_size,
                    image_tokens=MINIMAX_IMAGE_TOKENS if images else ())
    extra = {}
    if images:
        extra["image_token_index"] = len(SPECIAL_TOKENS) + 2
        (out / "preprocessor_config.json").write_text(json.dumps(
            {"image_processor_type": "MiniMaxM3VLImageProcessor", **MINIMAX_PIXELS}))
    torch.manual_seed(seed)
    config = AutoConfig.for_model("minimax_m3_vl", text_config=text.to_dict(),
                                  vision_config=VISION, tie_word_embeddings=False, **extra)
    config._attn_implementation = "eager"
    AutoModelForImageTextToText.from_config(config).float().save_pretrained(str(out))
    return out
