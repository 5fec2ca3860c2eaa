"""Renamed classes still import by their old names, warning which name replaces them and when the
old one is dropped."""

from __future__ import annotations

import importlib

import pytest
import torch

from sparkforge.shared.renamed import RENAMES_DROPPED_IN
from sparkforge.trainer.architectures.qwen3.model import Qwen3DraftModel
from sparkforge.trainer.architectures.tiny import draft_tiny

RENAMED_IN = ("sparkforge.trainer.lit_module", "sparkforge.trainer.draft.model",
              "sparkforge.trainer.draft.passes", "sparkforge.trainer.draft.config",
              "sparkforge.trainer.architectures.config",
              "sparkforge.trainer.architectures.deepseek_v4.config",
              "sparkforge.trainer.architectures.kimi_k3.config",
              "sparkforge.trainer.draft.layers",
              "sparkforge.trainer.architectures.gemma4.model",
              "sparkforge.trainer.architectures.kimi_k3.model",
              "sparkforge.trainer.architectures.deepseek_v4.model")
CASES = [(module, old, new) for module in RENAMED_IN
         for old, new in importlib.import_module(module).RENAMED.items()]


@pytest.mark.parametrize(("module", "old", "new"), CASES, ids=[f"{m}.{o}" for m, o, _ in CASES])
def test_an_old_name_is_the_new_class_with_a_future_warning(module: str, old: str,
                                                            new: str) -> None:
    """``from module import Old`` gives the new class (or layer builder) and a FutureWarning
    naming both names and the version that drops the old one."""
    with pytest.warns(FutureWarning, match=rf"{module}\.{old} is renamed {new}; .*"
                                           rf"{RENAMES_DROPPED_IN}"):
        got = getattr(importlib.import_module(module), old)
    assert got is getattr(importlib.import_module(module), new)
    assert getattr(got, "__name__", new) == new  # a layer builder (a partial) has no name


def test_the_tables_name_every_renamed_class() -> None:
    """The tables cover the renamed classes (so an emptied table fails here)."""
    assert {(old, new) for _, old, new in CASES} == {("DSparkLitModule", "DraftLitModule"),
                                                   ("DSparkOutput", "DraftOutput"),
                                                   ("DSparkDraftModel", "DraftModel"),
                                                   ("DSparkDraftConfig", "DraftConfig"),
                                                   ("DraftConfig", "SharedDraftConfig"),
                                                   ("DeepseekV4Fields", "DeepseekV4Options"),
                                                   ("KimiK3Fields", "KimiK3Options"),
                                                   ("DSparkAttention", "DraftAttention"),
                                                   ("DSparkLayer", "DraftDecoderLayer"),
                                                   ("Gemma4DSparkModel", "Gemma4DraftModel"),
                                                   ("Gemma4DSparkLayer", "Gemma4DraftLayer"),
                                                   ("K3DSparkModel", "KimiK3DraftModel"),
                                                   ("K3DSparkLayer", "KimiK3DraftLayer"),
                                                   ("DeepseekV4DSparkModel",
                                                    "DeepseekV4DraftModel"),
                                                   ("DeepseekV4DSparkAttention",
                                                    "DeepseekV4DraftAttention"),
                                                   ("DeepseekV4DSparkLayer",
                                                    "DeepseekV4DraftLayer")}


def test_the_old_qwen3_model_name_builds_the_qwen3_draft() -> None:
    """``DSparkDraftModel`` (served as ``DraftModel``) builds what ``Qwen3DraftModel`` builds:
    the same parameter names, shapes and seeded values."""
    with pytest.warns(FutureWarning):
        from sparkforge.trainer.draft.model import DSparkDraftModel
    cfg = draft_tiny()
    torch.manual_seed(0)
    old = DSparkDraftModel(cfg).state_dict()
    torch.manual_seed(0)
    new = Qwen3DraftModel(cfg).state_dict()
    assert list(old) == list(new)
    assert all(torch.equal(old[k], new[k]) for k in new)


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    """A name that is neither defined nor renamed raises AttributeError, not a warning."""
    with pytest.raises(AttributeError, match="has no attribute 'DSparkNothing'"):
        _ = importlib.import_module("sparkforge.trainer.lit_module").DSparkNothing


def test_the_old_config_name_reads_a_saved_config() -> None:
    """``DSparkDraftConfig`` (served as ``DraftConfig``) reads what ``DraftConfig`` saved and
    builds the same config."""
    with pytest.warns(FutureWarning, match="DSparkDraftConfig is renamed DraftConfig"):
        from sparkforge.trainer.architectures.config import DSparkDraftConfig
    cfg = draft_tiny()
    assert DSparkDraftConfig.from_dict(cfg.to_dict()) == cfg
