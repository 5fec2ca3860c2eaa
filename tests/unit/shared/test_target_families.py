"""Target families: lookup by model_type, and V4/V4.1 DSpark ids checked against vLLM's reader."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparkforge.shared.target_families import (
    STANDARD,
    TargetScaling,
    family_of,
    loads_as_image_text,
)

FEATURE_IDS = (40, 41, 42)


@pytest.mark.parametrize(("model_type", "family", "features", "final"), [
    ("qwen3", "qwen3", "residual", "post_norm"),
    ("qwen3_moe", "qwen3", "residual", "post_norm"),
    ("qwen3_next", "qwen3_next", "residual", "lm_head_input"),
    ("qwen3_5_moe_text", "qwen3_next", "residual", "lm_head_input"),
    ("llama", "standard", "residual", "post_norm"),
    ("gemma4_text", "gemma", "residual", "lm_head_input"),
    ("gemma4", "gemma", "residual", "lm_head_input"),
    ("kimi_linear", "kimi_k3", "residual", "lm_head_input"),
    ("deepseek_v4", "deepseek_v4", "hc_mean", "lm_head_input"),
    ("deepseek_v41", "deepseek_v41", "hc_mean", "lm_head_input"),
    ("glm_moe_dsa", "glm_dsa", "residual", "post_norm"),
    ("minimax_m3_vl", "minimax_m3", "residual", "lm_head_input"),
])
def test_family_semantics(model_type: str, family: str, features: str, final: str) -> None:
    """Each model_type maps to its family's feature and final-state semantics; only post_norm
    families have their final state finished offline from the last residual."""
    found = family_of(model_type)
    assert (found.name, found.features, found.final_state) == (family, features, final)
    assert found.final_from_residual == (final == "post_norm")


def test_scaling_comes_from_the_text_config() -> None:
    """Gemma scales embeddings by sqrt(H); the softcap is the config's (None when absent)."""
    gemma, qwen = family_of("gemma4_text"), family_of("qwen3")
    assert gemma.scaling({"hidden_size": 144, "final_logit_softcapping": 30}) == TargetScaling(
        embedding_scale=12.0, final_logit_softcapping=30.0)
    assert qwen.scaling({"hidden_size": 144}) == TargetScaling()


@pytest.mark.parametrize(("config", "match"), [
    ({"hidden_size": "144"}, "hidden_size must be a positive integer"),
    ({"hidden_size": 144, "final_logit_softcapping": 0}, "final_logit_softcapping must be"),
    ({"hidden_size": 144, "final_logit_softcapping": True}, "final_logit_softcapping must be"),
])
def test_bad_scaling_fields_are_named(config: dict, match: str) -> None:
    """A config whose hidden size or softcap cannot give a scaling names the field."""
    with pytest.raises(ValueError, match=match):
        family_of("gemma4_text").scaling(config)


@pytest.mark.parametrize(("model_type", "image_text"), [
    ("minimax_m3_vl", True), ("minimax_m3_vl_text", False), ("qwen3", False), (None, False)])
def test_image_text_top_levels(model_type: str | None, image_text: bool) -> None:
    """Only multimodal top levels without a causal-LM class load as image-text models."""
    assert loads_as_image_text(model_type) is image_text


def test_unknown_model_type_is_standard() -> None:
    """An unlisted model_type gets the Llama/Qwen-style family."""
    assert family_of("some_future_llm") is STANDARD


@pytest.mark.parametrize("model_type", ["deepseek_v4", "deepseek_v41"])
def test_builtin_dspark_ids_capture_feature_outputs_in_vllm(model_type: str) -> None:
    """vLLM's own id reader turns the written ids into aux ids l + 1 (V4.1 reads them as-is)."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )

    offset = family_of(model_type).vllm_dspark_id_offset
    written = tuple(i + 1 - offset for i in FEATURE_IDS)
    hf_config = SimpleNamespace(model_type=model_type, dspark_target_layer_ids=list(written))
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config))
    assert tuple(get_eagle3_aux_layers_from_config(spec)) == tuple(i + 1 for i in FEATURE_IDS)
    assert written == (FEATURE_IDS if model_type == "deepseek_v4" else (41, 42, 43))
