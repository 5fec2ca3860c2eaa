"""The one reader of a target's config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkforge.shared.target_config import parse_target_config, read_target_config


def test_text_config_is_lifted_over_the_top_level(tmp_path: Path) -> None:
    """Nested text_config sizes win, top-level keys stay, model_type is the top-level one."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_vl", "tie_word_embeddings": True, "hidden_size": 1,
        "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 4096}}))
    config = read_target_config(tmp_path)
    assert config.model_type == "qwen3_vl"
    assert config.text["model_type"] == "qwen3_vl_text"
    assert config.positive_int("hidden_size") == 4096
    assert config.text["tie_word_embeddings"] is True


def test_plain_config_reads_as_itself() -> None:
    """Without text_config the text settings are the top level."""
    config = parse_target_config(b'{"model_type": "qwen3", "num_hidden_layers": 36}', "c.json")
    assert config.model_type == "qwen3"
    assert config.positive_int("num_hidden_layers") == 36


@pytest.mark.parametrize(("data", "message"), [
    (b"[1, 2]", "c.json: expected a JSON object"),
    (b"{not json", "c.json: not valid JSON"),
    (b'{"hidden_size": true}', "c.json: config field hidden_size must be a positive integer"),
    (b'{"hidden_size": 0}', "c.json: config field hidden_size must be a positive integer"),
])
def test_bad_configs_are_named(data: bytes, message: str) -> None:
    """Non-objects, broken JSON and non-positive or boolean sizes name the file and field."""
    with pytest.raises(ValueError, match=message):
        parse_target_config(data, "c.json").positive_int("hidden_size")


def _gemma4_json(**kw: object) -> bytes:
    from sparkforge.app.tiny_target import tiny_gemma4_config

    return json.dumps(tiny_gemma4_config(**kw).to_dict()).encode()


@pytest.mark.parametrize("multimodal", [False, True], ids=["gemma4_text", "gemma4"])
def test_gemma4_full_attention_settings_come_from_its_per_layer_config(multimodal: bool) -> None:
    """Gemma4's top-level head_dim is the sliding layers'; the full-attention one is read."""
    config = parse_target_config(_gemma4_json(multimodal=multimodal), "c.json")
    assert config.text["head_dim"] == 32   # what a generic reader would wrongly take
    assert config.head_dim() == 64
    assert config.attention["num_key_value_heads"] == 1
    assert config.attention["rope_parameters"]["rope_type"] == "proportional"
    assert config.embedding_scale == 8.0   # sqrt(64)
    assert config.final_logit_softcapping == 30.0


def test_checkpoint_spelling_of_gemma4_global_sizes_is_read() -> None:
    """global_head_dim / num_global_key_value_heads (no per_layer_config) give the same sizes."""
    config = parse_target_config(json.dumps({
        "model_type": "gemma4_text", "hidden_size": 64, "num_attention_heads": 2,
        "head_dim": 32, "global_head_dim": 64, "num_global_key_value_heads": 1,
        "attention_k_eq_v": True, "num_key_value_heads": 2}), "c.json")
    assert (config.head_dim(), config.attention["num_key_value_heads"]) == (64, 1)


def test_plain_targets_have_no_scale_no_cap_and_derived_head_dim() -> None:
    """A config without head_dim derives it; non-Gemma targets have scale 1 and no cap."""
    config = parse_target_config(
        b'{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}', "c.json")
    assert (config.head_dim(), config.embedding_scale, config.final_logit_softcapping) == (
        16, 1.0, None)


@pytest.mark.parametrize("cap", ["30", 0, -1.0, True])
def test_bad_softcap_is_named(cap: object) -> None:
    """A softcap that is not a positive number names the file and the field."""
    config = parse_target_config(json.dumps({"final_logit_softcapping": cap}), "c.json")
    with pytest.raises(ValueError, match="c.json: config field final_logit_softcapping"):
        _ = config.final_logit_softcapping
