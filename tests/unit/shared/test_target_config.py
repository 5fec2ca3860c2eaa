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
