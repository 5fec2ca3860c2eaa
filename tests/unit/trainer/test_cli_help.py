"""`sparkforge train/eval --help` describe every sparkforge option (attribute docstrings)."""

from __future__ import annotations

import re

import pytest

from sparkforge.app.cli import main


@pytest.mark.parametrize(("command", "prefix"), [("train", "--model."), ("train", "--data."),
                                               ("eval", "--")])
def test_every_option_has_a_description(command: str, prefix: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """No sparkforge-owned flag in --help goes straight to its '(type: ...)' line."""
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    bare = re.findall(r"^  (\S+)[^\n]*\n +\(type:", out, flags=re.MULTILINE)
    bare += re.findall(r"^  (\S+) +\(type:", out, flags=re.MULTILINE)
    ours = [flag for flag in bare if flag.startswith(prefix) and not flag.endswith(".help")]
    assert "--model.draft.block_size" in out if command == "train" else "--max_new_tokens" in out
    if command == "train":  # the architecture's options show as one object of the draft
        assert "--model.draft.options" in out
    assert ours == []


def test_export_help_names_its_engine_choices(capsys: pytest.CaptureFixture[str]) -> None:
    """export --help shows the engine type as a Literal, not a parser-internal lambda repr."""
    assert main(["export", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--engine {vllm,sglang,any}" in out
    assert "<function" not in out
