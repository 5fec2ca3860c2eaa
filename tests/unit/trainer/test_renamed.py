"""Renamed classes still import by their old names, warning which name replaces them and when the
old one is dropped."""

from __future__ import annotations

import importlib

import pytest

from sparkforge.shared.renamed import RENAMES_DROPPED_IN

RENAMED_IN = ("sparkforge.trainer.lit_module", "sparkforge.trainer.draft.model",
              "sparkforge.trainer.draft.passes")
CASES = [(module, old, new) for module in RENAMED_IN
         for old, new in importlib.import_module(module).RENAMED.items()]


@pytest.mark.parametrize(("module", "old", "new"), CASES, ids=[f"{m}.{o}" for m, o, _ in CASES])
def test_an_old_name_is_the_new_class_with_a_future_warning(module: str, old: str,
                                                            new: str) -> None:
    """``from module import Old`` gives the new class and a FutureWarning naming both names and
    the version that drops the old one."""
    with pytest.warns(FutureWarning, match=rf"{module}\.{old} is renamed {new}; .*"
                                           rf"{RENAMES_DROPPED_IN}"):
        got = getattr(importlib.import_module(module), old)
    assert got is getattr(importlib.import_module(module), new)
    assert got.__name__ == new


def test_the_table_names_both_renamed_generic_classes() -> None:
    """The table covers both renamed generic classes (so an emptied table fails here)."""
    assert {(old, new) for _, old, new in CASES} == {("DSparkLitModule", "DraftLitModule"),
                                                   ("DSparkOutput", "DraftOutput")}


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    """A name that is neither defined nor renamed raises AttributeError, not a warning."""
    with pytest.raises(AttributeError, match="has no attribute 'DSparkNothing'"):
        _ = importlib.import_module("sparkforge.trainer.lit_module").DSparkNothing
