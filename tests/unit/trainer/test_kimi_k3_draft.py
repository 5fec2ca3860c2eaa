"""The Kimi-K3 draft against transformers' DeepSeek-V3 MLA layer; its config and key set."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_families import text_config
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RotaryEmbedding,
)

from sparkforge.trainer.architectures import build_draft
from sparkforge.trainer.architectures.config import DraftConfig, from_target_config
from sparkforge.trainer.architectures.kimi_k3.config import KimiK3Options
from sparkforge.trainer.architectures.kimi_k3.export import (
    expected_shapes,
    hf_config,
    serving_problems,
)
from sparkforge.trainer.architectures.kimi_k3.model import KimiK3DraftLayer
from sparkforge.trainer.draft.rope import RotaryEmbedding
from sparkforge.trainer.export import OPTIONAL_KEYS, config_from_hf

# transformers builds DeepSeek-V3's q_a/kv_a norms with eps 1e-6 whatever rms_norm_eps says;
# vLLM's K3 draft uses rms_norm_eps for every norm, so the comparison pins both to 1e-6.
EPS = 1e-6


def _draft_config(**overrides: object) -> DraftConfig:
    """A kimi_k3 draft config derived from the tiny Kimi-Linear target (q_lora_rank set)."""
    fields = {"options": {"q_lora_rank": 32}, "num_hidden_layers": 1, "num_anchors": 8,
              "markov_rank": 16, "block_size": 4, "rms_norm_eps": EPS, **overrides}
    return from_target_config(text_config("kimi_linear"), mask_token_id=3,
                              target_layer_ids=(0, 1, 2), architecture="kimi_k3", **fields)


def _hf_config(cfg: DraftConfig) -> DeepseekV3Config:
    opts = cfg.options
    hf = DeepseekV3Config(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, q_lora_rank=opts.q_lora_rank,
        kv_lora_rank=opts.kv_lora_rank, qk_nope_head_dim=opts.qk_nope_head_dim,
        qk_rope_head_dim=opts.qk_rope_head_dim, v_head_dim=opts.v_head_dim,
        first_k_dense_replace=1, num_hidden_layers=1, rms_norm_eps=EPS, rope_interleave=True,
        rope_parameters=dict(cfg.rope_parameters), max_position_embeddings=256)
    hf._attn_implementation = "eager"
    return hf


def _pair(seed: int = 0) -> tuple[DeepseekV3DecoderLayer, torch.nn.Module, DraftConfig]:
    """transformers' dense DeepSeek-V3 MLA layer with random weights, and ours holding them."""
    cfg = _draft_config()
    torch.manual_seed(seed)
    hf = DeepseekV3DecoderLayer(_hf_config(cfg), 0).eval()
    with torch.no_grad():
        for p in hf.parameters():   # norms around 1, projections small: nothing is trivial
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
    ours = KimiK3DraftLayer(cfg).eval()
    ours.load_state_dict(hf.state_dict())   # strict: the same names and shapes
    return hf, ours, cfg


def _hf_rope(cfg: DraftConfig, positions: torch.Tensor,
             x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = DeepseekV3RotaryEmbedding(_hf_config(cfg))(x, positions[None])
    return cos, sin


def _our_rope(cfg: DraftConfig, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    rope = RotaryEmbedding(cfg.options.qk_rope_head_dim, cfg.rope_parameters,
                           cfg.max_position_embeddings, interleaved=True)
    return rope(positions[None], torch.float32)


def test_target_gives_the_mla_sizes_and_a_missing_q_lora_rank_is_named() -> None:
    """MLA sizes come from the Kimi target; its absent q_lora_rank is an error naming the field."""
    cfg = _draft_config()
    opts = cfg.options
    assert (opts.kv_lora_rank, opts.qk_nope_head_dim, opts.qk_rope_head_dim, opts.v_head_dim) == (
        16, 16, 8, 16)
    assert (cfg.head_dim, cfg.num_key_value_heads) == (24, 4)
    with pytest.raises(ValueError, match="q_lora_rank=0: vLLM's K3DSparkForCausalLM needs"):
        from_target_config(text_config("kimi_linear"), mask_token_id=3, architecture="kimi_k3")
    with pytest.raises(ValueError, match="kv_lora_rank=16: only architecture='kimi_k3' reads"):
        dataclasses.replace(cfg, architecture="qwen3", options=KimiK3Options(kv_lora_rank=16))


def test_layer_equals_transformers_mla_layer_over_a_block() -> None:
    """Without context, our layer is transformers' dense DeepSeek-V3 MLA layer, all visible."""
    hf, ours, cfg = _pair()
    x = torch.randn(1, 6, cfg.hidden_size)
    pos = torch.arange(6)
    with torch.no_grad():
        want = hf(x, attention_mask=torch.zeros(1, 1, 6, 6),
                  position_embeddings=_hf_rope(cfg, pos, x), position_ids=pos[None])
        empty_k = torch.zeros(1, cfg.num_attention_heads, 0, cfg.head_dim)
        empty_v = torch.zeros(1, cfg.num_attention_heads, 0, cfg.options.v_head_dim)
        got = ours(x, _our_rope(cfg, pos), (empty_k, empty_v), None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_context_latents_equal_transformers_attention_over_the_context(masked: bool) -> None:
    """Block queries over injected context K/V equal transformers' MLA over [ctx ; block]."""
    hf, ours, cfg = _pair(seed=1)
    ctx, blk = torch.randn(1, 9, cfg.hidden_size), torch.randn(1, 4, cfg.hidden_size)
    rows = torch.cat([ctx, blk], dim=1)
    allowed = torch.ones(1, 1, 13, 13, dtype=torch.bool)
    if masked:   # block query j sees the context before position 3 + 2j and the whole block
        for j in range(4):
            allowed[0, 0, 9 + j, 3 + 2 * j:9] = False
    additive = torch.zeros(1, 1, 13, 13).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        want, _ = hf.self_attn(rows, _hf_rope(cfg, torch.arange(13), rows), additive)
        ctx_kv = ours.self_attn.key_values(ctx, *_our_rope(cfg, torch.arange(9)))
        got = ours.self_attn(blk, _our_rope(cfg, torch.arange(9, 13)), ctx_kv,
                             allowed[:, :, 9:] if masked else None)
    torch.testing.assert_close(got, want[:, 9:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change", [{}, {"num_hidden_layers": 2},
                                    {"enable_confidence_head": False}])
def test_state_dict_is_exactly_the_served_key_set(change: dict[str, object]) -> None:
    """Every parameter but the shared embed/lm_head is an exported key with its shape."""
    cfg = dataclasses.replace(_draft_config(), **change)
    state = {k: tuple(v.shape) for k, v in build_draft(cfg).state_dict().items()}
    assert set(OPTIONAL_KEYS) <= set(state)
    assert {k: s for k, s in state.items() if k not in OPTIONAL_KEYS} == expected_shapes(cfg)


def test_served_config_counts_features_and_reads_back() -> None:
    """config.json: k3_dspark, num_target_layers = feature count, target depth kept; reads back."""
    cfg = _draft_config(num_hidden_layers=2)
    config = hf_config(cfg)
    assert (config["model_type"], config["architectures"]) == ("k3_dspark", ["K3DSparkModel"])
    assert (config["num_target_layers"], config["target_num_hidden_layers"]) == (3, 4)
    assert (config["target_hidden_size"], config["draft_vocab_size"]) == (64, 1024)
    assert (config["n_routed_experts"], config["q_lora_rank"]) == (0, 32)
    assert config_from_hf(config) == dataclasses.replace(cfg, target_model_type="qwen3")


def test_export_refuses_sglang_and_scaled_rope() -> None:
    """SGLang has no K3 loader and vLLM serves non-default RoPE as DeepSeek YaRN: both named."""
    cfg = _draft_config()
    assert serving_problems(cfg, "vllm") == []
    assert any("SGLang has no Kimi-K3" in p for p in serving_problems(cfg, "any"))
    yarn = dataclasses.replace(cfg, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
        "original_max_position_embeddings": 1024})
    assert any("rope_type='yarn'" in p for p in serving_problems(yarn, "vllm"))
