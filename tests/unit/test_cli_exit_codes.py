"""One exit-code rule for every command: 0 done, 1 job or data failure, 2 usage or config error."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from sparkforge.app.cli import COMMANDS, main
from sparkforge.shared.errors import ConfigError, SparkforgeError

# (command, arguments, expected exit code, what the row shows). {tmp} is an existing empty folder,
# {missing} a path that names nothing.
CASES = [
    ("validate", ["{missing}"], 2, "a cache path that names nothing"),
    ("validate", ["{tmp}", "--against", "{missing}"], 2, "an --against file that is not there"),
    ("validate", ["{tmp}"], 1, "a folder that holds no cache is invalid"),
    ("validate", ["{tmp}", "--storage_options", "[1]"], 2, "storage options that are no object"),
    ("inspect", ["{missing}"], 2, "a cache path that names nothing"),
    ("plan", ["--hidden_size", "8", "--num_aux_layers", "1", "--num_tokens", "-1"], 2,
     "a negative token count"),
    ("status", ["{missing}"], 2, "a cache path that names nothing"),
    ("status", ["{tmp}", "--num_workers", "0"], 2, "no workers"),
    ("status", ["{tmp}"], 1, "a folder that holds no run"),
    ("finalize", [], 2, "the required --output left out"),
    ("finalize", ["--output", "{tmp}"], 1, "a folder that holds no run"),
    ("produce", ["--data", "d.jsonl", "--output", "o", "--engine.model", "m", "--window", "0"], 2,
     "a value the config refuses"),
    ("produce", ["--data", "d.jsonl", "--output", "o", "--engine.model", "m", "--rows_per_unit",
                 str(10**12)], 2, "units past the cache's slot address space"),
    ("regenerate", ["--data", "d.jsonl", "--output", "o", "--engine.model", "m", "--top_p", "5"],
     2, "a value the config refuses"),
    ("parity", ["--data", "d.jsonl", "--output", "o", "--engine.model", "m", "--backend", "hf",
                "--parity_samples", "-2"], 2, "a negative sample count"),
    ("train", ["--model.draft.mask_token_id", "3", "--model.draft.hidden_size", "8",
               "--model.draft.vocab_size", "16", "--model.draft.num_target_layers", "4",
               "--data.uri", "{tmp}", "--model.loss.l1_chunk_rows", "0"], 2,
     "a value the loss config refuses"),
    ("export", ["{missing}", "{tmp}", "--engine", "tensorrt"], 2, "an engine outside the choices"),
    ("eval", ["--draft", "d", "--target", "t", "--cache", "c", "--out_dir", "o",
              "--num_prompts", "0"], 2, "a value the config refuses"),
    ("demo", ["--rows", "many"], 2, "a value of the wrong type"),
]


def _fill(args: list[str], tmp_path: Path) -> list[str]:
    return [a.format(tmp=tmp_path, missing=tmp_path / "nothing-here") for a in args]


@pytest.mark.parametrize(("command", "args", "code", "why"), CASES,
                         ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in CASES])
def test_exit_code(command: str, args: list[str], code: int, why: str, tmp_path: Path) -> None:
    """Each command maps its outcome to the one rule (the row names the case)."""
    assert main([command, *_fill(args, tmp_path)]) == code, why


def test_every_command_has_a_config_error_row() -> None:
    """The table above covers every command in the CLI table."""
    assert {c[0] for c in CASES if c[2] == 2} == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_exits_0_and_an_unknown_option_exits_2(command: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--help is done (0) and shows the table's one-line help; an unknown flag is usage (2)."""
    assert main([command, "--help"]) == 0
    assert COMMANDS[command].help.split(" (")[0] in " ".join(capsys.readouterr().out.split())
    assert main([command, "--no_such_flag", "1"]) == 2


def test_no_command_or_an_unknown_one_is_a_usage_error() -> None:
    """`sparkforge` alone or with a command that does not exist exits 2; `--help` exits 0."""
    assert main([]) == 2
    assert main(["bogus"]) == 2
    assert main(["--help"]) == 0


PLAN = ["--hidden_size", "8", "--num_aux_layers", "1", "--num_tokens", "1"]


def _job_raising(exc: BaseException):
    def job(_cfg: object) -> int:
        raise exc
    return job


@pytest.mark.parametrize(("exc", "code"), [(SparkforgeError("bad row 3: expected an int"), 1),
                                           (ConfigError("--x: expected a path"), 2)])
def test_a_refusal_is_one_line_with_its_exit_code(exc: SparkforgeError, code: int,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The exit rule keys on the project's error root: its message, one line, and no traceback."""
    monkeypatch.setitem(COMMANDS, "plan", replace(COMMANDS["plan"], job=_job_raising(exc)))
    assert main(["plan", *PLAN]) == code
    err = capsys.readouterr().err
    assert err == f"sparkforge plan: error: {exc}\n"


@pytest.mark.parametrize("exc", [ValueError("math domain error"), RuntimeError("bug"),
                                 KeyError("k")])
def test_an_unexpected_exception_keeps_its_traceback(exc: Exception,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A ValueError from a library (not a refusal of ours) is a bug: it propagates unchanged."""
    monkeypatch.setitem(COMMANDS, "plan", replace(COMMANDS["plan"], job=_job_raising(exc)))
    with pytest.raises(type(exc)) as raised:
        main(["plan", *PLAN])
    assert raised.value is exc


_BUILTIN_ERRORS = {"Exception", "ValueError", "RuntimeError", "TypeError", "KeyError",
                   "OSError", "FileNotFoundError", "IOError"}


def test_every_project_error_class_has_the_error_root() -> None:
    """A class deriving from a built-in exception also derives from a project error (whose root is
    SparkforgeError): no refusal of ours escapes the exit rule as a bug."""
    root = Path(__file__).resolve().parents[2]
    orphans = []
    for path in sorted(p for d in ("shared", "manifests", "producer", "trainer")
                       for p in (root / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
                if bases and set(bases) <= _BUILTIN_ERRORS and node.name != "SparkforgeError":
                    orphans.append(f"{path.relative_to(root)}: {node.name}({', '.join(bases)})")
    assert orphans == []
    assert issubclass(SparkforgeError, ValueError)
    assert issubclass(ConfigError, SparkforgeError)


@pytest.mark.parametrize(("count", "message"), [
    (10_000, "a list of 10,000 items, more than the 1,024 one config list may hold"),
    (1_000, "ids [4, 5, 6"),
])
def test_thousands_of_layer_ids_are_a_short_config_error(
        tiny_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], count: int,
        message: str) -> None:
    """Ids the target does not have are a config error (2), and the echoed list is cut; a list
    past 1,024 items is refused before the parser's type check, whose cost grows with its square
    (10,000 ids took 31 s of CPU)."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    ids = "[" + ",".join(str(i) for i in range(1, count + 1)) + "]"
    assert main(["produce", "--backend", "hf", "--data", str(data), "--output",
                 str(tmp_path / "out"), "--engine.model", str(tiny_target),
                 "--layer_ids", ids]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert len(err) < 500, len(err)
    assert message in err


_MIX = "--mix"
# (command, arguments, exit code, text the one-line error holds): hostile values of the third
# round; each used to print a traceback or jsonargparse's multi-line union report.
REFUSALS = [
    ("produce", [_MIX, "[{data: d.jsonl, weight: .inf}]"], 2,
     "weight must be a number in (0, 1e+12]"),
    ("produce", [_MIX, "[{data: d.jsonl, weight: 1e308}, {data: d.jsonl, weight: 1e308}]"], 2,
     "got 1e+308"),
    ("produce", [_MIX, "[{data: d.jsonl, weight: .nan}]"], 2, "got nan"),
    ("produce", [_MIX, "[{data: d.jsonl, weight: -1}]"], 2, "got -1.0"),
    ("produce", [_MIX, "[{data: d.jsonl, weight: true}]"], 2, 'Parser key "weight"'),
    ("produce", [_MIX, "[{data: d.jsonl, weight: 1}]", "--mix_seed", "-1"], 2,
     "--mix_seed must be >= 0"),
    ("produce", [_MIX, "[{data: d.jsonl, weight: 1}]", "--mix_rows", str(10**12)], 2,
     "more than 10,000,000 units"),
    ("produce", [_MIX, "[{data: d.jsonl, weight: 1}]", "--mix_rows", str(10**9)], 2,
     "more than 10,000,000 units"),
    ("produce", [_MIX, "[{data: d.jsonl, weight: 1}]", "--mix_rows", "many"], 2,
     'Parser key "mix_rows": Expected a <class \'int\'>'),
]


@pytest.mark.parametrize(("command", "args", "code", "text"), REFUSALS,
                         ids=[" ".join(c[1])[:60] for c in REFUSALS])
def test_hostile_values_are_refused_in_one_line(command: str, args: list[str], code: int,
                                                text: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Each hostile value exits with its code and one line that says what is wrong."""
    base = ["--output", str(tmp_path / "o"), "--engine.model", str(tmp_path)]
    assert main([command, *base, *(a.replace("{tmp}", str(tmp_path)) for a in args)]) == code
    lines = capsys.readouterr().err.strip().splitlines()
    # One line, or a config's list of problems with one problem in it.
    assert len(lines) == 1 or (len(lines) == 2 and lines[0].endswith(" config:")), lines
    assert text in lines[-1], lines
