"""The vLLM CPU engine's host memory: sized from the run's KV ask, refused in one line up front.

vLLM's CPU worker reads ``gpu_memory_utilization`` as the share of host memory that must be free at
start; with the KV space unset, any share above the free fraction used to kill the engine with
"Engine core initialization failed" (issue 25 item 11).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sparkforge.app.tiny_text import demo_conversations

ENV = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}


def produce(tmp_path: Path, model: Path, env: dict[str, str],
            **engine: object) -> subprocess.CompletedProcess:
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in demo_conversations(4)))
    config = tmp_path / "producer.yaml"
    config.write_text(yaml.safe_dump({
        "backend": "vllm", "data": str(data), "output": str(tmp_path / "cache"),
        "layer_ids": [0, 1, 2], "hidden_dtype": "float32", "rows_per_unit": 4, "shard_rows": 256,
        "max_seq_len": 128, "overlong": "truncate", "parity_samples": 0, "progress": False,
        "engine": {"model": str(model), "dtype": "float32", "max_model_len": 128,
                   "max_num_seqs": 4, "enforce_eager": True, **engine}}))
    return subprocess.run([sys.executable, "-P", "-m", "sparkforge.app.cli", "produce",
                           "--config", str(config)], capture_output=True, text=True,
                          timeout=600, env=env)


def error_line(run: subprocess.CompletedProcess) -> str:
    lines = [line for line in run.stderr.splitlines() if line.startswith("sparkforge produce:")]
    assert len(lines) == 1, run.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_an_unset_kv_space_reserves_what_the_run_needs_not_a_share(tmp_path: Path,
                                                                    tiny_target: Path) -> None:
    """gpu_memory_utilization 1.0 (the whole host, never all free) still starts and captures."""
    env = {k: v for k, v in ENV.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    run = produce(tmp_path, tiny_target, env, gpu_memory_utilization=1.0)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "cache" / "manifest.json").is_file()
    assert "CPU engine: KV cache 1.00 GiB (the default (VLLM_CPU_KVCACHE_SPACE unset))" \
        in run.stderr


def test_a_kv_ask_beyond_free_memory_is_refused_in_one_line(tmp_path: Path,
                                                            tiny_target: Path) -> None:
    """The line names free vs wanted memory and the setting; no engine starts, nothing written."""
    run = produce(tmp_path, tiny_target, {**ENV, "VLLM_CPU_KVCACHE_SPACE": "100000"})
    assert run.returncode == 1, run.stderr[-3000:]
    line = error_line(run)
    assert "needs 100000.00 GiB of host memory" in line, line
    assert "GiB is free" in line, line
    assert "lower VLLM_CPU_KVCACHE_SPACE (GiB)" in line, line
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "EngineCore" not in run.stderr, "the refusal comes before any engine starts"
    assert not (tmp_path / "cache" / "manifest.json").exists()



def test_a_malformed_kv_space_is_a_config_error(tmp_path: Path, tiny_target: Path) -> None:
    run = produce(tmp_path, tiny_target, {**ENV, "VLLM_CPU_KVCACHE_SPACE": "lots"})
    assert run.returncode == 2, run.stderr[-3000:]
    assert "VLLM_CPU_KVCACHE_SPACE='lots' must be a whole number of GiB" in error_line(run)
