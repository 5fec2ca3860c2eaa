"""The deepseek_v4 draft: its attention against transformers' V4 attention and a hand-written
layer, its config derived from a V4 target, its tensor names, and its export refusal."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sparkforge.trainer.architectures import build_draft
from sparkforge.trainer.architectures.config import DraftConfig, from_target_config
from sparkforge.trainer.architectures.deepseek_v4.export import expected_shapes
from sparkforge.trainer.architectures.deepseek_v4.model import (
    DeepseekV4DraftAttention,
    DeepseekV4DraftLayer,
)
from sparkforge.trainer.architectures.deepseek_v4.tiny import draft_tiny_deepseek_v4
from sparkforge.trainer.architectures.options import options_dict
from sparkforge.trainer.architectures.tiny import draft_tiny
from sparkforge.trainer.draft.attention_mask import dense_allowed
from sparkforge.trainer.draft.rope import RotaryEmbedding
from sparkforge.trainer.export import ExportError, export_draft, key_problems

# Every tensor name a vLLM 0.32 DeepSeek-V4 DSpark stage reads (``mtp.{i}.`` stripped): the
# decoder layer's attention, norms and shared expert, and the head stack's pieces.
VLLM_V4_STAGE_NAMES = {
    "main_proj.weight", "main_norm.weight", "norm.weight",
    "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
    "confidence_head.proj.weight", "confidence_head.proj.bias",
    "attn_norm.weight", "ffn_norm.weight", "attn.wq_a.weight", "attn.q_norm.weight",
    "attn.wq_b.weight", "attn.wkv.weight", "attn.kv_norm.weight", "attn.wo_a.weight",
    "attn.wo_b.weight", "attn.attn_sink", "ffn.shared_experts.w1.weight",
    "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight",
}


def _v4_target_config(**overrides: Any) -> Any:
    from transformers import AutoConfig

    kwargs = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                  layer_types=["sliding_attention"] * 4, mlp_layer_types=["moe"] * 4,
                  sliding_window=8, index_n_heads=2, index_head_dim=16, index_topk=8, hc_mult=2,
                  num_nextn_predict_layers=0, partial_rotary_factor=0.25, swiglu_limit=7.0)
    config = AutoConfig.for_model("deepseek_v4", **{**kwargs, **overrides})
    config._attn_implementation = "eager"
    return config


def _v4_draft_config(target: Any, **overrides: Any) -> DraftConfig:
    return from_target_config(target, mask_token_id=3, target_layer_ids=(0, 1, 2),
                              architecture="deepseek_v4", num_hidden_layers=1, block_size=4,
                              num_anchors=4, markov_rank=8, **overrides)


def test_config_is_derived_from_the_v4_target() -> None:
    """Q-LoRA, O-LoRA, groups, rope slice, SwiGLU clamp and expert width come from the target."""
    target = _v4_target_config()
    cfg = _v4_draft_config(target)
    opts = cfg.options
    assert (opts.q_lora_rank, opts.o_lora_rank, opts.o_groups) == (32, 16, 2)
    assert cfg.options.qk_rope_head_dim == 8 == target.qk_rope_head_dim
    assert cfg.intermediate_size == 48     # the experts' width, not intermediate_size
    assert cfg.num_key_value_heads == 1
    assert cfg.options.swiglu_limit == 7.0
    assert cfg.rope_parameters["rope_theta"] == target.rope_parameters["main"]["rope_theta"]
    qwen3 = from_target_config(target, mask_token_id=3, target_layer_ids=(0, 1, 2))
    assert (qwen3.architecture, qwen3.options) == ("qwen3", None)


def test_v4_architecture_needs_a_v4_target() -> None:
    """architecture='deepseek_v4' on a Qwen3 target is refused, naming the missing fields."""
    from transformers import Qwen3Config

    target = Qwen3Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=4,
                         vocab_size=256, intermediate_size=128)
    with pytest.raises(ValueError, match=r"'qwen3' target config has no \['moe_intermediate_size'"):
        from_target_config(target, mask_token_id=3, target_layer_ids=(0, 1),
                           architecture="deepseek_v4")


@pytest.mark.parametrize(("base", "change", "message"), [
    (draft_tiny_deepseek_v4, {"num_key_value_heads": 2}, "one key/value latent"),
    (draft_tiny_deepseek_v4, {"options": {"o_groups": 3}}, "multiple of options.o_groups=3"),
    (draft_tiny_deepseek_v4, {"options": {"qk_rope_head_dim": 7}},
     "qk_rope_head_dim=7 must be even"),
    (draft_tiny_deepseek_v4, {"options": {"qk_rope_head_dim": 32}}, "at most head_dim=16"),
    (draft_tiny_deepseek_v4, {"options": {"q_lora_rank": 0}}, "q_lora_rank=0 must be > 0"),
    (draft_tiny, {"options": {"o_lora_rank": 8}}, "only architecture='deepseek_v4' reads it"),
])
def test_invalid_v4_fields_are_refused(base: Any, change: dict[str, Any], message: str) -> None:
    """Each inconsistent V4 attention field is named in the config error."""
    cfg = base()
    if "options" in change:
        change = {**change, "options": {**options_dict(cfg.options), **change["options"]}}
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(cfg, **change)


def test_attention_equals_transformers_v4_attention() -> None:
    """Block queries over [context < anchor ; block] equal transformers' DeepSeek-V4 attention."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4Attention,
        DeepseekV4RotaryEmbedding,
    )

    target = _v4_target_config()
    cfg = _v4_draft_config(target)
    torch.manual_seed(0)
    hf = DeepseekV4Attention(target, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    ours = DeepseekV4DraftAttention(cfg)
    renames = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
               "kv_norm": "kv_norm", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
    state = {f"{ours_name}.weight": hf.get_parameter(f"{hf_name}.weight")
             for ours_name, hf_name in renames.items()} | {"attn_sink": hf.sinks}
    ours.load_state_dict(state)

    seq, anchor, k = 9, 6, 4
    ctx, block = torch.randn(1, seq, 64), torch.randn(1, k, 64)
    pos = torch.cat([torch.arange(seq), anchor + torch.arange(k)])[None]
    allowed = dense_allowed(torch.tensor([[anchor]]), torch.tensor([[True]]), seq, k)
    mask = torch.zeros(1, 1, seq + k, seq + k)
    mask[:, :, :seq] = torch.where(torch.eye(seq + k, dtype=torch.bool)[:seq], 0.0, -math.inf)
    mask[:, :, seq:] = torch.where(allowed, 0.0, -math.inf)
    rope_hf = DeepseekV4RotaryEmbedding(target)(ctx, pos, layer_type="main")
    with torch.no_grad():
        want = hf(torch.cat([ctx, block], 1), {"main": rope_hf}, pos, mask)[0][:, seq:]
        rope = RotaryEmbedding(cfg.options.qk_rope_head_dim, cfg.rope_parameters,
                               cfg.max_position_embeddings, interleaved=True)
        got = ours(block, rope(pos[:, seq:], block.dtype),
                   ours.key_values(ctx, *rope(pos[:, :seq], ctx.dtype)), allowed)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _rotate(x: np.ndarray, position: int, inv_freq: np.ndarray, sign: float) -> np.ndarray:
    """Rotate the trailing 2*len(inv_freq) channels of one vector pair by pair."""
    out = x.copy()
    start = len(x) - 2 * len(inv_freq)
    for i, freq in enumerate(inv_freq):
        c, s = math.cos(position * freq), sign * math.sin(position * freq)
        a, b = x[start + 2 * i], x[start + 2 * i + 1]
        out[start + 2 * i], out[start + 2 * i + 1] = a * c - b * s, a * s + b * c
    return out


def _rms(x: np.ndarray, weight: np.ndarray | float, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x) + eps) * weight


def _hand_layer(layer: DeepseekV4DraftLayer, cfg: DraftConfig, ctx: np.ndarray,
                block: np.ndarray, anchor: int) -> np.ndarray:
    """One V4 draft layer for one block, query by query and head by head, in float64."""
    w = {n: p.detach().double().numpy() for n, p in layer.named_parameters()}
    eps, n_heads, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.head_dim
    opts, rope_dim = cfg.options, cfg.options.qk_rope_head_dim
    inv = 1.0 / 10_000.0 ** (np.arange(0, rope_dim, 2) / rope_dim)

    def latent(row: np.ndarray, position: int) -> np.ndarray:
        kv = _rms(w["attn.wkv.weight"] @ row, w["attn.kv_norm.weight"], eps)
        return _rotate(kv, position, inv, 1.0)

    normed = [_rms(x, w["attn_norm.weight"], eps) for x in block]
    keys = [latent(ctx[j], j) for j in range(anchor)]
    keys += [latent(x, anchor + i) for i, x in enumerate(normed)]
    out = []
    for i, x in enumerate(normed):
        q_all = w["attn.wq_b.weight"] @ _rms(w["attn.wq_a.weight"] @ x, w["attn.q_norm.weight"],
                                             eps)
        heads = []
        for h in range(n_heads):
            q = _rotate(_rms(q_all[h * d:(h + 1) * d], 1.0, eps), anchor + i, inv, 1.0)
            scores = [q @ key / math.sqrt(d) for key in keys] + [w["attn.attn_sink"][h]]
            probs = np.exp(np.array(scores) - max(scores))
            probs /= probs.sum()
            o = sum(p * key for p, key in zip(probs[:-1], keys, strict=True))
            heads.append(_rotate(o, anchor + i, inv, -1.0))
        flat = np.concatenate(heads)
        per_group = len(flat) // opts.o_groups
        wo_a = w["attn.wo_a.weight"].reshape(opts.o_groups, opts.o_lora_rank, per_group)
        low = np.concatenate([wo_a[g] @ flat[g * per_group:(g + 1) * per_group]
                              for g in range(opts.o_groups)])
        h1 = block[i] + w["attn.wo_b.weight"] @ low
        f = _rms(h1, w["ffn_norm.weight"], eps)
        limit = opts.swiglu_limit
        gate = np.minimum(w["ffn.shared_experts.w1.weight"] @ f, limit)
        up = np.clip(w["ffn.shared_experts.w3.weight"] @ f, -limit, limit)
        out.append(h1 + w["ffn.shared_experts.w2.weight"] @ (gate / (1 + np.exp(-gate)) * up))
    return np.stack(out)


def test_layer_equals_a_hand_written_computation() -> None:
    """A draft layer equals a float64 loop over queries and heads (sink, clamp, groups, RoPE)."""
    tiny = draft_tiny_deepseek_v4()
    cfg = dataclasses.replace(tiny, options=dataclasses.replace(tiny.options, swiglu_limit=0.3),
                              rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    torch.manual_seed(1)
    layer = DeepseekV4DraftLayer(cfg)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    seq, anchor, k = 10, 7, cfg.block_size
    ctx, block = torch.randn(1, seq, 64), torch.randn(1, k, 64)
    rope = RotaryEmbedding(cfg.options.qk_rope_head_dim, cfg.rope_parameters,
                           cfg.max_position_embeddings, interleaved=True)
    allowed = dense_allowed(torch.tensor([[anchor]]), torch.tensor([[True]]), seq, k)
    with torch.no_grad():
        got = layer(block, rope(anchor + torch.arange(k)[None], block.dtype),
                    layer.key_values(ctx, *rope(torch.arange(seq)[None], ctx.dtype)), allowed)
    want = _hand_layer(layer, cfg, ctx[0].double().numpy(), block[0].double().numpy(), anchor)
    np.testing.assert_allclose(got[0].double().numpy(), want, rtol=1e-4, atol=1e-4)


def test_tensor_names_are_vllm_v4_stage_names() -> None:
    """Every trained tensor is named as in vLLM's V4 DSpark stages, with the expected shape."""
    cfg = draft_tiny_deepseek_v4()
    state = {k: v for k, v in build_draft(cfg).state_dict().items()
             if k not in ("embed_tokens.weight", "lm_head.weight")}
    assert {k.split(".", 2)[2] if k.startswith("layers.") else k for k in state} \
        == VLLM_V4_STAGE_NAMES
    assert key_problems(cfg, state) == []
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_shapes(cfg)


def test_export_refuses_with_the_reasons(tmp_path: Path) -> None:
    """Export of a deepseek_v4 draft is refused for every engine, naming why; nothing is written."""
    cfg = draft_tiny_deepseek_v4()
    tensors = build_draft(cfg).state_dict()
    for engine in ("vllm", "sglang", "any"):
        with pytest.raises(ExportError, match=r"mtp\.\{i\} stages .* hyper-connection"):
            export_draft(cfg, tensors, tmp_path / "out", engine=engine)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


def test_v4_flash_example_builds_its_contract_and_draft_config() -> None:
    """The V4-Flash example parses into the recipe's contract and, with V4-Flash's config (no
    weights), into a deepseek_v4 draft config of the published sizes."""
    import yaml
    from transformers import AutoConfig

    from sparkforge.trainer.run_config import DraftSpec
    from sparkforge.trainer.train_yaml import contract_from_train_config

    path = Path(__file__).resolve().parents[3] / "trainer" / "examples" / "deepseek_v4_flash.yaml"
    contract = contract_from_train_config(path)
    assert contract.target_layer_ids == (40, 41, 42)
    assert (contract.features, contract.final_hidden) == ("hc_mean", "lm_head_input")
    assert contract.mask_token_id == 128_799
    spec = DraftSpec(**yaml.safe_load(path.read_text())["model"]["draft"])
    flash = AutoConfig.for_model("deepseek_v4").to_dict()   # transformers' defaults: V4-Flash
    cfg = spec.draft_config(flash)
    assert cfg.architecture == "deepseek_v4"
    assert (cfg.block_size, cfg.target_layer_ids, cfg.markov_rank, cfg.mask_token_id) == (
        5, (40, 41, 42), 256, 128_799)
    opts = cfg.options
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, opts.q_lora_rank,
            opts.o_groups, opts.o_lora_rank, opts.qk_rope_head_dim, cfg.intermediate_size,
            opts.swiglu_limit) == (4096, 64, 512, 1024, 8, 1024, 64, 2048, 10.0)
    shapes = expected_shapes(cfg)
    assert len(shapes) == 3 + 13 * cfg.num_hidden_layers + 4
    assert shapes["layers.0.attn.wo_a.weight"] == (8 * 1024, 64 * 512 // 8)
