"""An architecture's own fields live in the config's ``options``; the flat layout before it
(top-level keys in a saved config or a run's overrides) still reads."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
from tiny_families import text_config

from sparkforge.shared.errors import ConfigError
from sparkforge.trainer.architectures import ARCHITECTURES, DRAFT_PAIRS, tiny_draft
from sparkforge.trainer.architectures.config import LEGACY_DROPPED_IN, DraftConfig
from sparkforge.trainer.architectures.deepseek_v4.config import DeepseekV4Options
from sparkforge.trainer.architectures.kimi_k3.config import KimiK3Options
from sparkforge.trainer.run_config import DraftSpec

# Every architecture option a flat config held, at its default (the flat layout wrote them all).
FLAT_DEFAULTS = {"q_lora_rank": 0, "qk_rope_head_dim": 0, "o_lora_rank": 0, "o_groups": 0,
                 "swiglu_limit": None, "kv_lora_rank": 0, "qk_nope_head_dim": 0,
                 "v_head_dim": 0}


def _flat(cfg: DraftConfig) -> dict[str, Any]:
    """``cfg`` saved as a checkpoint stored it before ``options`` existed."""
    data = cfg.to_dict()
    options = data.pop("options") or {}
    return {**data, **FLAT_DEFAULTS, **options}


def test_the_options_of_every_architecture_are_its_entrys_class() -> None:
    """Each tiny config holds its architecture's options class (None where it has none), and
    the flat defaults above are exactly the options' fields (so a new option fails here)."""
    for name, arch in ARCHITECTURES.items():
        options = tiny_draft(name).options
        assert (type(options) if options is not None else None) is arch.options
    names = {f.name: f.default for kind in (DeepseekV4Options, KimiK3Options)
             for f in dataclasses.fields(kind)}
    assert names == FLAT_DEFAULTS


@pytest.mark.parametrize(("architecture", "layout"), DRAFT_PAIRS)
def test_a_config_saved_flat_loads_as_the_same_config(architecture: str, layout: str,
                                                      tmp_path: Path) -> None:
    """A saved config of the flat layout (every architecture's options as top-level keys)
    reads, without a warning, as the config that holds them in ``options``."""
    cfg = tiny_draft(architecture, layout)
    old = _flat(cfg)
    assert "options" not in old
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DraftConfig.from_dict(old) == cfg
    cfg.save(tmp_path / "draft_config.json")
    assert DraftConfig.load(tmp_path / "draft_config.json") == cfg


def test_options_are_saved_nested() -> None:
    """``to_dict`` writes the options as one object, and none for an architecture without."""
    assert tiny_draft("kimi_k3").to_dict()["options"] == {
        "q_lora_rank": 32, "qk_rope_head_dim": 8, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
        "v_head_dim": 16}
    assert tiny_draft("qwen3").to_dict()["options"] is None
    assert not set(FLAT_DEFAULTS) & set(tiny_draft("deepseek_v4").to_dict())


def test_a_flat_option_of_another_architecture_is_refused_naming_its_reader() -> None:
    """A qwen3 config saved flat with a kimi_k3 option set is refused, as before."""
    old = {**_flat(tiny_draft("qwen3")), "kv_lora_rank": 16}
    with pytest.raises(ConfigError, match="kv_lora_rank=16: only architecture='kimi_k3' reads"):
        DraftConfig.from_dict(old)


def test_an_unknown_option_is_refused() -> None:
    """An option no architecture has is named, with the ones this architecture reads."""
    with pytest.raises(ConfigError, match=r"options.q_rank: no architecture has this option"):
        dataclasses.replace(tiny_draft("kimi_k3"), options={"q_rank": 8})


def _kimi_spec(**fields: Any) -> DraftSpec:
    return DraftSpec(mask_token_id=3, hidden_size=64, vocab_size=1024, num_target_layers=4,
                     target_layer_ids=(0, 1, 2), num_hidden_layers=1, block_size=4,
                     num_anchors=8, markov_rank=16, architecture="kimi_k3", **fields)


def test_flat_overrides_read_as_options_with_a_future_warning() -> None:
    """``model.draft.overrides.q_lora_rank`` (the old place) builds the draft that
    ``model.draft.options.q_lora_rank`` builds, warning where the option goes and when the old
    place stops being read; the other MLA sizes still come from the target."""
    target = text_config("kimi_linear").to_dict()
    new = _kimi_spec(options={"q_lora_rank": 32}).draft_config(target)
    with pytest.warns(FutureWarning, match=rf"model.draft.overrides: q_lora_rank .* "
                                           rf"model.draft.options .*{LEGACY_DROPPED_IN}"):
        old = _kimi_spec(overrides={"q_lora_rank": 32}).draft_config(target)
    assert old == new
    assert new.options == KimiK3Options(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=16)
