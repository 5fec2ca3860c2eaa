"""Served eval's options: what vLLM is started with, and what is refused before any decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparkforge.shared.errors import ConfigError, SparkforgeError
from sparkforge.trainer.architectures import tiny_draft
from sparkforge.trainer.eval.served import CPU_DSPARK, check_servable, speculative_config
from sparkforge.trainer.eval.served_engine import SERVER_MODULE, server_command
from sparkforge.trainer.job_config import EvalConfig, ServedOptions


def _cfg(draft: str, **kw: object) -> EvalConfig:
    return EvalConfig(draft=draft, target="t", out_dir="o", cache="c", **kw)  # type: ignore[arg-type]


def test_server_command_serves_the_draft_with_per_request_counts() -> None:
    """The draft goes in as --speculative-config with per-request acceptance counts; engine
    arguments follow produce's names; extra arguments come last, as given; a baseline server
    has no draft."""
    options = ServedOptions(tensor_parallel_size=8, enable_expert_parallel=True,
                            dtype="bfloat16", max_model_len=8192,
                            extra_args=["--enforce-eager"])
    spec = {"method": "dflash", "model": "/d", "num_speculative_tokens": 6}
    cmd = server_command("/models/t", spec, options, port=8123, seed=3)
    assert cmd[1:3] == ["-m", SERVER_MODULE]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--model"] == "/models/t"
    assert flags["--host"] == "127.0.0.1"
    assert flags["--tensor-parallel-size"] == "8"
    assert flags["--max-model-len"] == "8192"
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == spec
    assert cmd[cmd.index("--per-request-spec-decode-metrics") + 1] == "detailed"
    assert "--enable-expert-parallel" in cmd
    assert cmd[-1] == "--enforce-eager"
    baseline = server_command("/models/t", None, options, port=8123, seed=3)
    assert "--speculative-config" not in baseline
    assert "--per-request-spec-decode-metrics" not in baseline


def test_the_dflash_export_is_served_with_its_method_and_sampling(tmp_path: Path) -> None:
    """A DFlash draft is served with method dflash, the absolute export path, and (by default)
    probabilistic drafting, the rule the reference decoder follows."""
    cfg = _cfg(str(tmp_path), engine="vllm")
    spec = speculative_config(cfg, tiny_draft("qwen3", "dflash"), 3)
    assert spec == {"method": "dflash", "model": str(tmp_path.resolve()),
                    "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM serves DSpark on a GPU")
def test_dspark_on_cpu_is_refused_in_one_line(tmp_path: Path) -> None:
    """vLLM's CPU build cannot serve DSpark (the V2 runner needs Triton): said before decoding."""
    with pytest.raises(ConfigError) as info:
        check_servable(_cfg(str(tmp_path), engine="vllm"), tiny_draft("qwen3"))
    assert str(info.value) == CPU_DSPARK
    assert "\n" not in CPU_DSPARK
    check_servable(_cfg(str(tmp_path), engine="vllm"), tiny_draft("qwen3", "dflash"))


def test_a_checkpoint_is_not_servable(tmp_path: Path) -> None:
    """--engine vllm needs the exported folder, not the training checkpoint."""
    with pytest.raises(ConfigError, match="sparkforge export"):
        check_servable(_cfg(str(tmp_path / "last.ckpt"), engine="vllm"),
                       tiny_draft("qwen3", "dflash"))


@pytest.mark.parametrize(("fields", "problem"), [
    ({"engine": "vllm", "endpoint": "http://x"}, "--engine or --endpoint"),
    ({"reference": False, "cache": None, "prompts": "p"}, "nothing would be measured"),
    ({"endpoint": "http://x", "served": ServedOptions(concurrency=[1, 0])}, "concurrency: 0"),
    ({"engine": "vllm", "served": ServedOptions(num_speculative_tokens=[0])},
     "num_speculative_tokens: 0"),
])
def test_bad_served_settings_are_refused(fields: dict[str, object], problem: str) -> None:
    """Each bad combination names its flag."""
    with pytest.raises(SparkforgeError, match=problem):
        EvalConfig(**{"draft": "d", "target": "t", "out_dir": "o", "cache": "c",  # type: ignore[arg-type]
                      **fields})
