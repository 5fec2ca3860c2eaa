"""Config YAML is bounded: an alias bomb or an oversized file is refused in one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sparkforge.app.cli import main
from sparkforge.shared.config_yaml import MAX_CONFIG_CHARS, check_yaml, expanded_nodes
from sparkforge.shared.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def alias_bomb(levels: int = 9) -> str:
    """Each anchor lists the previous one ten times: 10**levels strings once expanded."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_expanded_nodes_counts_each_alias_use() -> None:
    """By hand: the mapping, two keys, [1, 2] (3 nodes) and [*x, *x] (1 + 3 + 3)."""
    node = yaml.compose("a: &x [1, 2]\nb: [*x, *x]\n", Loader=yaml.SafeLoader)
    assert expanded_nodes(node) == 1 + 1 + 3 + 1 + 7


def test_ordinary_aliases_pass_and_a_bomb_or_a_huge_text_does_not() -> None:
    check_yaml("base: &b {lr: 1.0e-3}\nrun: {<<: *b, steps: 3}\n", "c.yaml")
    with pytest.raises(ConfigError, match=r"^c.yaml: its YAML aliases expand to more than "
                                          r"1,000,000 nodes \(an alias bomb\?\)"):
        check_yaml(alias_bomb(), "c.yaml")
    with pytest.raises(ConfigError, match=r"^c.yaml: more than the [\d,]+ characters a config"):
        check_yaml("x: " + "a" * MAX_CONFIG_CHARS, "c.yaml")


@pytest.mark.parametrize("command", ["produce", "train", "validate --against"])
def test_an_alias_bomb_config_is_refused_with_exit_2(command: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """produce and train --config, and validate --against, refuse the bomb before expanding it
    (it used to grow them past 5 GB; validate called it valid)."""
    base = (ROOT / "trainer/examples/tiny.yaml").read_text() if command != "produce" else (
        "data: d.jsonl\noutput: o\nengine:\n  model: m\n  extra:\n")
    indent = "    " if command == "produce" else ""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(base + "".join(f"{indent}{line}\n" for line in alias_bomb().splitlines()))
    argv = {"produce": ["produce", "--config", str(bomb)],
            "train": ["train", "--config", str(bomb)],
            "validate --against": ["validate", str(tmp_path), "--against", str(bomb)]}[command]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "its YAML aliases expand to more than 1,000,000 nodes" in captured.err
