"""ProducerConfig validation and the producer CLI's parsing (YAML, dotted overrides, errors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sparkforge.app.cli import main
from sparkforge.producer.config import ProducerConfig
from sparkforge.producer.engine_options import EngineOptions

BASE = {"data": "d.jsonl", "output": "out", "engine": {"model": "m", "max_model_len": 256},
        "shard_rows": 512}


def make(**overrides: object) -> ProducerConfig:
    fields = {**BASE, **overrides}
    return ProducerConfig(**{**fields, "engine": EngineOptions(**fields["engine"])})


@pytest.mark.parametrize(
    ("overrides", "flags"),
    [
        ({"rows_per_unit": 0}, ["--rows_per_unit"]),
        ({"topk": -1, "window": 0}, ["--topk", "--window"]),
        ({"eval_fraction": 1.5}, ["--eval_fraction"]),
        ({"eval_fraction": 0.1, "eval_ids": "ids.txt"}, ["--eval_fraction and --eval_ids"]),
        ({"layer_ids": [3, 1]}, ["--layer_ids"]),
        ({"layer_ids": []}, ["--layer_ids"]),
        ({"max_seq_len": 1024}, ["--max_seq_len", "--engine.max_model_len"]),
        ({"shard_rows": 5_000_000}, ["--shard_rows (5000000)", "must be <= 4,194,304"]),
        ({"worker_index": 1}, ["--worker_index and --num_workers"]),
        ({"worker_index": 2, "num_workers": 2}, ["--worker_index must be in"]),
        ({"parity_samples": -1}, ["--parity_samples"]),
        ({"template_row_seconds": 0.0}, ["--template_row_seconds must be > 0"]),
        ({"template_row_seconds": float("nan")}, ["--template_row_seconds must be > 0"]),
        ({"data": "", "output": ""}, ["--data", "--output"]),
    ],
)
def test_each_problem_names_its_flag(overrides: dict, flags: list[str]) -> None:
    """Every invalid field is reported, by flag name, in one ValueError."""
    with pytest.raises(ValueError, match="invalid producer config") as info:
        make(**overrides)
    for flag in flags:
        assert flag in str(info.value)


def test_all_problems_in_one_error() -> None:
    """Several bad fields are collected into one message, one line each."""
    with pytest.raises(ValueError, match="invalid producer config") as info:
        make(rows_per_unit=0, topk=-2, eval_fraction=-1.0)
    assert str(info.value).count("\n") == 3


def test_shard_rows_below_max_seq_len_is_accepted() -> None:
    """A sample longer than a shard spans several: --shard_rows no longer depends on the
    sample length (it sizes the writer's buffers)."""
    assert make(shard_rows=64).shard_rows < make(shard_rows=64).seq_len


def test_eval_fraction_one_is_accepted() -> None:
    """An eval-only cache (eval_fraction 1.0) is a valid producer config."""
    assert make(eval_fraction=1.0).eval_fraction == 1.0


def test_identity_leaves_out_run_local_fields() -> None:
    """Worker index, window, retries and storage credentials never reach the cache header."""
    a = make(worker_index=0, num_workers=2, window=8, storage_options={"secret": "x"})
    b = make(worker_index=1, num_workers=2, window=64)
    assert a.identity() == b.identity()
    assert "storage_options" not in a.identity()
    assert a.identity()["max_seq_len"] == 256
    # a prompt of max_model_len (256) tokens leaves vLLM no room for the token it generates
    assert (a.longest_sample, make(max_seq_len=100).longest_sample) == (255, 100)
    assert make(topk=4).identity() != a.identity()


def test_template_kwargs_are_part_of_the_cache_identity() -> None:
    """Template variables change the rendered tokens, so they are in the header (and a resume
    with others is refused); none leaves the identity as it was before the field existed."""
    assert "chat_template_kwargs" not in make().identity()
    thinking = make(chat_template_kwargs={"enable_thinking": True}).identity()
    assert thinking["chat_template_kwargs"] == {"enable_thinking": True}
    assert thinking != make(chat_template_kwargs={"enable_thinking": False}).identity()
    with pytest.raises(ValueError, match="'add_generation_prompt' is apply_chat_template"):
        make(chat_template_kwargs={"add_generation_prompt": True})


def test_cli_yaml_with_dotted_overrides_and_print_config(tmp_path: Path, capsys) -> None:
    """--config YAML plus --engine.x overrides resolve; --print_config shows the result."""
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(BASE))
    code = main(["produce", "--config", str(path), "--engine.tensor_parallel_size", "2",
                 "--topk", "4", "--print_config"])
    assert code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["engine"]["tensor_parallel_size"] == 2
    assert printed["topk"] == 4
    assert printed["data"] == "d.jsonl"


def test_cli_config_errors_exit_2_naming_flags(tmp_path: Path, capsys) -> None:
    """An invalid config is a usage error (exit 2) whose message names each bad flag."""
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert main(["produce", "--config", str(path), "--rows_per_unit", "0", "--window", "0"]) == 2
    err = capsys.readouterr().err
    assert "--rows_per_unit" in err
    assert "--window" in err
    assert main(["produce", "--config", str(path), "--no_such_flag", "1"]) == 2
    assert main(["bogus"]) == 2


@pytest.mark.parametrize(("name", "layer_ids"),
                         [("tiny.yaml", [0, 2]), ("qwen3-8b.yaml", [1, 9, 17, 25, 33])])
def test_example_configs_parse(name: str, layer_ids: list[int]) -> None:
    """The shipped example configs are valid producer configs."""
    from importlib.resources import files

    from sparkforge.app.cli import parse_dataclass

    path = files("sparkforge.producer") / "examples" / name
    cfg = parse_dataclass("sparkforge produce", "", ProducerConfig, ["--config", str(path)])
    assert cfg.layer_ids == layer_ids
    assert cfg.seq_len <= cfg.shard_rows
