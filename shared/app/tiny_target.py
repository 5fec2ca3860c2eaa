"""Build tiny targets (model, tokenizer, chat template) offline, for demos and tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on an embedded synthetic corpus
(``tiny_text``) and the weights are random (std 0.08, so next-token distributions are not
near-uniform).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparkforge.app.tiny_minimax_vl import build_tiny_minimax_vl
from sparkforge.app.tiny_text import (
    SPECIAL_TOKENS,
    build_tokenizer,
    demo_conversations,
    write_chats,
)
from sparkforge.app.tiny_vl import image_conversations

IMAGE_TOKENS = ("<|image>", "<image|>", "<|image|>")
"""Begin-of-image, end-of-image and image tokens of the tiny multimodal Gemma4 (ids 4, 5, 6)."""


def build_tiny_target(
    out_dir: str | Path,
    *,
    num_hidden_layers: int = 4,
    hidden_size: int = 128,
    head_dim: int = 32,
    vocab_size: int = 1024,
    generation_markers: bool = True,
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    """Write a tiny Qwen3ForCausalLM + tokenizer to ``out_dir`` and return the path.

    head_dim stays >= 32 because vLLM's CPU attention supports no smaller head size.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, vocab_size=vocab_size, generation_markers=generation_markers)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=max(1, hidden_size // head_dim // 2),
        head_dim=head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.08,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(out))
    return out


def build_tiny_deepseek_v4(
    out_dir: str | Path,
    *,
    num_hidden_layers: int = 4,
    hidden_size: int = 64,
    hc_mult: int = 2,
    vocab_size: int = 1024,
    seed: int = 0,
) -> Path:
    """Write a tiny DeepSeek-V4 (hyper-connection streams, MoE, ``hc_head``) + tokenizer.

    Sliding-window attention only (no compressed attention), no MTP layers; fp32 weights.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, vocab_size=vocab_size)
    config = AutoConfig.for_model(
        "deepseek_v4", vocab_size=vocab_size, hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=32,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        layer_types=["sliding_attention"] * num_hidden_layers,
        mlp_layer_types=["moe"] * num_hidden_layers, sliding_window=8,
        index_n_heads=2, index_head_dim=16, index_topk=8, hc_mult=hc_mult,
        num_nextn_predict_layers=0, max_position_embeddings=4096, initializer_range=0.08,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # uneven stream weights, so hc_head is not a plain mean
        model.model.hc_head.hc_base.normal_(0.0, 2.0)
    model.save_pretrained(str(out))
    return out


TINY_PATCH, TINY_POOLING = 4, 2
"""Patch side and pooling kernel of the tiny Gemma4 vision tower and its image processor."""


def tiny_gemma4_config(
    *, num_hidden_layers: int = 4, hidden_size: int = 64, vocab_size: int = 1024,
    final_logit_softcapping: float | None = 30.0, multimodal: bool = False,
) -> Any:
    """A tiny Gemma4 text config (or the ``gemma4`` multimodal top level holding it).

    Sliding layers have head_dim 32 and 2 KV heads, the full-attention last layer head_dim 64 and
    one KV head with ``attention_k_eq_v``; no per-layer inputs, no MoE.
    """
    from transformers import AutoConfig

    layer_types = ["sliding_attention"] * (num_hidden_layers - 1) + ["full_attention"]
    text = AutoConfig.for_model(
        "gemma4_text", vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=2 * hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, global_head_dim=64,
        num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=layer_types,
        sliding_window=16, hidden_size_per_layer_input=0, vocab_size_per_layer_input=vocab_size,
        final_logit_softcapping=final_logit_softcapping, max_position_embeddings=4096,
        initializer_range=0.08, tie_word_embeddings=False, bos_token_id=None, eos_token_id=2,
        pad_token_id=0,
    )
    if not multimodal:
        return text
    # Image tokens are the tokenizer's IMAGE_TOKENS; vision tokens attend to their whole image.
    text.use_bidirectional_attention = "vision"
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
              "patch_size": TINY_PATCH, "pooling_kernel_size": TINY_POOLING,
              "position_embedding_size": 64}
    boi, eoi, image = (len(SPECIAL_TOKENS) + i for i in range(3))
    return AutoConfig.for_model("gemma4", text_config=text.to_dict(), vision_config=vision,
                                tie_word_embeddings=False, boi_token_id=boi, eoi_token_id=eoi,
                                image_token_id=image)


def build_tiny_gemma4(out_dir: str | Path, *, seed: int = 0, **config: Any) -> Path:
    """Write a tiny Gemma4 target (see ``tiny_gemma4_config``; ``multimodal=True`` for the top
    level with a tiny vision tower, its image tokens and its PIL image processor) + tokenizer.

    fp32 weights, untied lm_head, and a final norm weight away from 1 so the pre-norm and
    post-norm states differ.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = tiny_gemma4_config(**config)
    build_tokenizer(out, vocab_size=text_vocab_size(hf),
                    image_tokens=IMAGE_TOKENS if config.get("multimodal") else ())
    torch.manual_seed(seed)
    if config.get("multimodal"):
        from transformers.models.gemma4.image_processing_pil_gemma4 import (
            Gemma4ImageProcessorPil,
        )

        Gemma4ImageProcessorPil(patch_size=TINY_PATCH, pooling_kernel_size=TINY_POOLING,
                                max_soft_tokens=70).save_pretrained(str(out))
        model = AutoModelForImageTextToText.from_config(hf).float()
    else:
        hf._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(hf).float()
    with torch.no_grad():
        model.get_decoder().norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(str(out))
    return out


def text_vocab_size(config: Any) -> int:
    """The vocabulary size of a text config or of a multimodal config's ``text_config``."""
    return int(getattr(config, "text_config", config).vocab_size)


VL_MODEL_TYPES = ("gemma4", "minimax_m3_vl")
"""``--model_type`` values that build a multimodal top level and write image chats."""


def _builder(model_type: str) -> Callable[..., Path]:
    """The function that writes a tiny target of ``model_type`` (the multimodal ones with their
    image processor)."""
    builders: dict[str, Callable[..., Path]] = {
        "qwen3": build_tiny_target, "deepseek_v4": build_tiny_deepseek_v4,
        "gemma4": functools.partial(build_tiny_gemma4, multimodal=True),
        "minimax_m3_vl": build_tiny_minimax_vl}
    return builders[model_type]


def main(argv: list[str] | None = None) -> int:
    """``python -m sparkforge.app.tiny_target OUT [--rows N] [--model_type T]``: a tiny target
    (Qwen3, DeepSeek-V4, or a multimodal top level with its image processor: Gemma4 or
    MiniMax-M3 VL) + demo chat JSONL (for the multimodal ones, every other row carries small
    generated images, some under OUT/images)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rows", type=int, default=0, help="also write OUT/chat.jsonl")
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model_type", choices=("qwen3", "deepseek_v4", *VL_MODEL_TYPES),
                        default="qwen3")
    args = parser.parse_args(argv)
    _builder(args.model_type)(args.out_dir, num_hidden_layers=args.num_hidden_layers,
                              seed=args.seed)
    if args.rows:
        if args.model_type in VL_MODEL_TYPES:
            rows = image_conversations(args.rows, args.out_dir / "images", seed=args.seed)
        else:
            rows = demo_conversations(args.rows, seed=args.seed)
        write_chats(args.out_dir / "chat.jsonl", rows)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
