"""The Gemma4 draft against transformers' Gemma4 layer, attention and target; its key set."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4TextDecoderLayer,
    Gemma4TextRotaryEmbedding,
)

from sparkforge.app.tiny_target import tiny_gemma4_config
from sparkforge.trainer.architectures import build_draft
from sparkforge.trainer.architectures.config import DraftConfig, from_target_config
from sparkforge.trainer.architectures.gemma4.export import expected_shapes
from sparkforge.trainer.architectures.gemma4.model import Gemma4DraftLayer, Gemma4DraftModel
from sparkforge.trainer.draft.draft_batch import DraftBatch
from sparkforge.trainer.draft.rope import RotaryEmbedding

FULL = 1   # the full-attention layer of a 2-layer tiny Gemma4 target


def _pair(seed: int = 0) -> tuple[Gemma4TextDecoderLayer, Gemma4DraftLayer, DraftConfig]:
    """transformers' full-attention Gemma4 layer with random weights, and ours holding them."""
    hf_cfg = tiny_gemma4_config(num_hidden_layers=2)
    hf_cfg._attn_implementation = "eager"
    cfg = from_target_config(hf_cfg, mask_token_id=3, target_layer_ids=(0,), num_hidden_layers=1,
                             architecture="gemma4")
    torch.manual_seed(seed)
    hf = Gemma4TextDecoderLayer(hf_cfg, FULL).eval()
    with torch.no_grad():
        for p in hf.parameters():   # norms around 1, projections small: nothing is trivial
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
    ours = Gemma4DraftLayer(cfg).eval()
    ours.load_state_dict({k: v for k, v in hf.state_dict().items() if k != "layer_scalar"})
    return hf, ours, cfg


def _hf_rope(positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rope = Gemma4TextRotaryEmbedding(tiny_gemma4_config(num_hidden_layers=2))
    cos, sin = rope(x, positions[None], "full_attention")
    return cos, sin


def _full_mask(n: int) -> torch.Tensor:
    return torch.zeros(1, 1, n, n)


def test_draft_takes_the_targets_full_attention_shape() -> None:
    """head_dim 64 and one KV head come from the full-attention layer, not config.head_dim."""
    _, ours, cfg = _pair()
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads) == (64, 1, 2)
    assert cfg.rope_parameters["rope_type"] == "proportional"
    assert ours.self_attn.v_proj is None
    assert ours.self_attn.v_norm is not None
    assert ours.self_attn.v_norm.weight is None


def test_layer_equals_transformers_gemma4_layer_over_a_block() -> None:
    """Without context, our layer is transformers' k_eq_v Gemma4 layer with full visibility."""
    hf, ours, cfg = _pair()
    x = torch.randn(1, 6, cfg.hidden_size)
    pos = torch.arange(6)
    with torch.no_grad():
        want = hf(x, per_layer_input=None, shared_kv_states={},
                  position_embeddings=_hf_rope(pos, x), attention_mask=_full_mask(6),
                  position_ids=pos[None])
        rope = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters, cfg.max_position_embeddings)
        empty = torch.zeros(1, cfg.num_key_value_heads, 0, cfg.head_dim)
        got = ours(x, rope(pos[None], x.dtype), (empty, empty), None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_context_keys_and_values_equal_transformers_attention_over_the_context() -> None:
    """Block queries over injected context K/V equal transformers' attention over [ctx ; block]."""
    hf, ours, cfg = _pair(seed=1)
    ctx, blk = torch.randn(1, 9, cfg.hidden_size), torch.randn(1, 4, cfg.hidden_size)
    rows = torch.cat([ctx, blk], dim=1)
    with torch.no_grad():
        want, _ = hf.self_attn(rows, _hf_rope(torch.arange(13), rows), _full_mask(13),
                               shared_kv_states={})
        rope = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters, cfg.max_position_embeddings)
        ctx_kv = ours.self_attn.key_values(ctx, *rope(torch.arange(9)[None], ctx.dtype))
        got = ours.self_attn(blk, rope(torch.arange(9, 13)[None], blk.dtype), ctx_kv, None)
    torch.testing.assert_close(got, want[:, 9:], rtol=1e-5, atol=1e-5)


def test_embedding_and_teacher_logits_equal_the_gemma4_target() -> None:
    """sqrt(H)-scaled embedding and softcapped teacher logits equal transformers' Gemma4 target."""
    from transformers import AutoModelForCausalLM

    hf_cfg = tiny_gemma4_config(final_logit_softcapping=2.0)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(hf_cfg).eval()
    cfg = from_target_config(hf_cfg, mask_token_id=3, target_layer_ids=(0, 1),
                             num_hidden_layers=1, num_anchors=4, markov_rank=8,
                             architecture="gemma4")
    draft = build_draft(cfg, embed_weight=target.model.embed_tokens.weight,
                        lm_head_weight=target.lm_head.weight)
    assert isinstance(draft, Gemma4DraftModel)
    ids = torch.randint(4, 1024, (1, 16))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        d = draft(DraftBatch(ids, torch.ones(1, 16), torch.cat(out.hidden_states[1:3], -1),
                             out.hidden_states[-1]))
        torch.testing.assert_close(draft.embed(ids), target.model.embed_tokens(ids))
    assert out.logits.abs().max() <= 2.0   # the cap bites: raw logits would exceed it
    for n in range(4):
        a = int(d.anchor_positions[0, n])
        for k in range(int(d.eval_mask[0, n].sum())):
            torch.testing.assert_close(d.target_logits[0, n, k], out.logits[0, a + k])


@pytest.mark.parametrize("change", [{}, {"num_hidden_layers": 2, "attention_bias": True},
                                    {"enable_confidence_head": False}])
def test_state_dict_is_exactly_the_served_key_set(change: dict[str, object]) -> None:
    """Every parameter the model has is an exported key with its shape, and nothing else."""
    _, _, cfg = _pair()
    cfg = dataclasses.replace(cfg, **change)
    model = build_draft(cfg)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected_shapes(cfg)


def test_norms_round_once_in_bf16_as_transformers_gemma4_does() -> None:
    """In bf16 the Gemma norm equals transformers' Gemma4RMSNorm bit for bit (weight applied in
    fp32 before the cast); Qwen3's order (cast, then multiply in bf16) does not."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    from sparkforge.trainer.draft.layers import GemmaRMSNorm, RMSNorm

    torch.manual_seed(0)
    x = (3.0 * torch.randn(64, 256)).bfloat16()
    weight = (1.0 + 0.3 * torch.randn(256)).bfloat16()
    hf, ours, qwen = Gemma4RMSNorm(256, eps=1e-6), GemmaRMSNorm(256, 1e-6), RMSNorm(256, 1e-6)
    for norm in (hf, ours, qwen):
        norm.bfloat16().weight.data.copy_(weight)
    with torch.no_grad():
        expected = hf(x)
        assert torch.equal(ours(x), expected)
        assert not torch.equal(qwen(x), expected)
        weightless = Gemma4RMSNorm(256, eps=1e-6, with_scale=False)(x)
        assert torch.equal(GemmaRMSNorm(256, 1e-6, with_weight=False)(x), weightless)


def test_every_norm_of_the_gemma4_draft_is_gemmas() -> None:
    """The layers', the attention's, the context and the final norms all use Gemma's order."""
    from sparkforge.trainer.draft.layers import GemmaRMSNorm, RMSNorm

    _, _, cfg = _pair()
    model = Gemma4DraftModel(cfg)
    norms = {n: type(m) for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    assert {"hidden_norm", "norm", "layers.0.self_attn.q_norm", "layers.0.self_attn.v_norm",
            "layers.0.post_feedforward_layernorm"} <= set(norms)
    assert set(norms.values()) == {GemmaRMSNorm}


@pytest.mark.parametrize("hidden", [640, 2560, 5376])
def test_embedding_scale_is_rounded_to_bf16_as_transformers_does(hidden: int) -> None:
    """sqrt(H) rounded to bf16 before the multiply, as Gemma4TextScaledWordEmbedding does; the
    exact scale gives other bf16 values at these real hidden sizes."""
    import math
    from types import SimpleNamespace

    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

    from sparkforge.trainer.draft.passes import embed

    torch.manual_seed(0)
    hf = Gemma4TextScaledWordEmbedding(32, hidden, 0, embed_scale=math.sqrt(hidden)).bfloat16()
    stack = SimpleNamespace(embed_tokens=torch.nn.Embedding(32, hidden).bfloat16(),
                            config=SimpleNamespace(embedding_scale=math.sqrt(hidden)),
                            lm_head=SimpleNamespace(weight=hf.weight))
    stack.embed_tokens.weight.data.copy_(hf.weight.data)
    ids = torch.arange(32)
    with torch.no_grad():
        expected = hf(ids)
        assert torch.equal(embed(stack, ids), expected)  # type: ignore[arg-type]
        assert not torch.equal(stack.embed_tokens(ids) * math.sqrt(hidden), expected)
