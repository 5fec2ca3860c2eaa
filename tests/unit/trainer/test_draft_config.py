"""Draft config: derivation from the target, validation, default ids, JSON, served key names."""

from __future__ import annotations

import dataclasses
import logging
import math
import types
from pathlib import Path

import pytest
from transformers import Qwen3Config

from sparkforge.shared.layer_ids import default_feature_ids
from sparkforge.trainer.architectures.config import DraftConfig, from_target_config
from sparkforge.trainer.architectures.qwen3.export import serving_config
from sparkforge.trainer.architectures.qwen3.model import Qwen3DraftModel
from sparkforge.trainer.architectures.tiny import draft_tiny


def _qwen3(**kw: object) -> Qwen3Config:
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "intermediate_size": 96, "num_hidden_layers": 8, "vocab_size": 300,
            "rms_norm_eps": 1e-5}
    return Qwen3Config(**{**base, **kw})


def test_from_target_config_copies_sizes() -> None:
    """Sizes, eps, rope and L come from the target; DSpark defaults apply."""
    cfg = from_target_config(_qwen3(), mask_token_id=7)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 4, 2)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (16, 96, 300)
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.num_target_layers == 8
    assert cfg.rope_parameters["rope_theta"] == _qwen3().rope_parameters["rope_theta"]
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.num_anchors) == (5, 7, 512)
    assert (cfg.markov_rank, cfg.markov_head_type) == (256, "vanilla")
    assert cfg.target_layer_ids == default_feature_ids(8, 5)


def test_nested_text_config_is_used() -> None:
    """A VL-style target with a nested text_config is read through it."""
    outer = types.SimpleNamespace(model_type="qwen3_vl", text_config=_qwen3(hidden_size=32,
                                                                             head_dim=8))
    cfg = from_target_config(outer, mask_token_id=1, target_layer_ids=(0, 2))
    assert cfg.hidden_size == 32
    assert cfg.head_dim == 8
    assert cfg.target_model_type == "qwen3"


def test_gemma_scale_and_softcap_come_from_the_target() -> None:
    """Gemma targets give the sqrt(H) embedding scale and their final logit softcap."""
    gemma = types.SimpleNamespace(**_qwen3().to_dict())
    gemma.model_type, gemma.final_logit_softcapping = "gemma4_text", 30.0
    cfg = from_target_config(gemma, mask_token_id=1, target_layer_ids=(1, 2))
    assert cfg.embedding_scale == pytest.approx(math.sqrt(64))
    assert cfg.final_logit_softcapping == 30.0
    assert from_target_config(_qwen3(), mask_token_id=1).embedding_scale == 1.0


@pytest.mark.parametrize("multimodal", [False, True], ids=["gemma4_text", "gemma4"])
def test_gemma4_target_gives_its_full_attention_shape_scale_and_cap(multimodal: bool) -> None:
    """A real Gemma4 config (reading config.head_dim raises) gives head_dim 64, 1 KV head,
    sqrt(H) and the softcap, for the text model and the multimodal top level alike."""
    from sparkforge.app.tiny_target import tiny_gemma4_config

    target = tiny_gemma4_config(multimodal=multimodal)
    with pytest.raises(RuntimeError, match="per-layer attribute"):
        _ = target.get_text_config().head_dim
    cfg = from_target_config(target, mask_token_id=3, target_layer_ids=(0, 2))
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads) == (64, 1, 2)
    assert cfg.embedding_scale == pytest.approx(8.0)
    assert cfg.final_logit_softcapping == 30.0
    assert cfg.rope_parameters == {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}
    assert (cfg.target_model_type, cfg.num_target_layers) == ("gemma4_text", 4)


def test_gemma4_train_config_path_builds_the_draft_config() -> None:
    """The trainer's path (the cache's config.json mapping) reads a Gemma4 target the same way."""
    from sparkforge.app.tiny_target import tiny_gemma4_config
    from sparkforge.trainer.run_config import DraftSpec

    spec = DraftSpec(mask_token_id=3, hidden_size=64, vocab_size=1024, num_target_layers=4,
                     target_layer_ids=(0, 2), architecture="gemma4")
    cfg = spec.draft_config(tiny_gemma4_config(multimodal=True).to_dict())
    assert (cfg.head_dim, cfg.architecture, cfg.final_logit_softcapping) == (64, "gemma4", 30.0)


@pytest.mark.parametrize("mask_id", [-1, 300, 10_000])
def test_mask_token_out_of_range_rejected(mask_id: int) -> None:
    """mask_token_id must lie in [0, V)."""
    with pytest.raises(ValueError, match="mask_token_id"):
        from_target_config(_qwen3(), mask_token_id=mask_id)


@pytest.mark.parametrize(
    ("ids", "match"),
    [((), "non-empty"), ((3, 3), "strictly increasing"), ((4, 2), "strictly increasing"),
     ((0, 8), "outside"), ((-2, 1), "outside")],
)
def test_layer_ids_validated(ids: tuple[int, ...], match: str) -> None:
    """Ids are non-empty, strictly increasing and in {-1} U [0, L-1]."""
    with pytest.raises(ValueError, match=match):
        from_target_config(_qwen3(), mask_token_id=1, target_layer_ids=ids)


def test_all_problems_reported_together() -> None:
    """One ValueError names every bad field."""
    with pytest.raises(ValueError, match="mask_token_id") as err:
        dataclasses.replace(draft_tiny(), mask_token_id=-1, block_size=0, markov_rank=-1)
    assert "block_size" in str(err.value)
    assert "markov_rank" in str(err.value)


@pytest.mark.parametrize(("ids", "warned"), [((-1, 3), True), ((2, 7), False)])
def test_only_the_embedding_id_warns(ids: tuple[int, ...], warned: bool,
                                     caplog: pytest.LogCaptureFixture) -> None:
    """Id -1 is accepted with a warning (no cache holds it); the last layer L-1 is a plain id."""
    with caplog.at_level(logging.WARNING):
        cfg = from_target_config(_qwen3(), mask_token_id=1, target_layer_ids=ids)
    assert cfg.target_layer_ids == ids
    assert ("keep ids in [0, 7]" in caplog.text) is warned


def test_json_round_trip(tmp_path: Path) -> None:
    """save/load reproduces the config exactly; unknown keys are rejected."""
    cfg = dataclasses.replace(draft_tiny(), markov_head_type="rnn", final_logit_softcapping=9.0)
    cfg.save(tmp_path / "draft.json")
    assert DraftConfig.load(tmp_path / "draft.json") == cfg
    with pytest.raises(ValueError, match="unknown"):
        DraftConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_state_dict_keys_are_the_served_keys() -> None:
    """Parameter names and shapes equal the served keys (11*L_d + 7 keys + embed/lm_head)."""
    cfg = dataclasses.replace(draft_tiny(), num_hidden_layers=2)
    sd = Qwen3DraftModel(cfg).state_dict()
    h, i, v, r, hd = 64, 128, 256, 16, 16
    expected = {"fc.weight": (h, 3 * h), "hidden_norm.weight": (h,), "norm.weight": (h,),
                "markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r),
                "confidence_head.proj.weight": (1, h + r), "confidence_head.proj.bias": (1,),
                "embed_tokens.weight": (v, h), "lm_head.weight": (v, h)}
    for n in range(2):
        p = f"layers.{n}."
        expected |= {p + "input_layernorm.weight": (h,),
                     p + "post_attention_layernorm.weight": (h,),
                     p + "self_attn.q_proj.weight": (4 * hd, h),
                     p + "self_attn.k_proj.weight": (2 * hd, h),
                     p + "self_attn.v_proj.weight": (2 * hd, h),
                     p + "self_attn.o_proj.weight": (h, 4 * hd),
                     p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                     p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                     p + "mlp.down_proj.weight": (h, i)}
    assert {k: tuple(t.shape) for k, t in sd.items()} == expected
    assert len(expected) - 2 == 11 * 2 + 7


def test_serving_config_fields() -> None:
    """The served config carries the DSpark fields vLLM/SGLang read, never a gated head silently."""
    out = serving_config(draft_tiny())
    assert out["architectures"] == ["Qwen3DSparkModel"]
    assert out["model_type"] == "qwen3"
    assert out["target_layer_ids"] == [0, 1, 2]
    assert out["num_target_layers"] == 4
    assert out["confidence_head_with_markov"] is True
    assert out["markov_head_type"] == "vanilla"
    assert out["layer_types"] == ["full_attention"]
