"""``sparkforge regenerate`` (real vLLM engine) reads a ShareGPT Hugging Face dataset."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from producer_helpers import chat_rows

datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.slow
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
       "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def test_regenerate_reads_a_sharegpt_save_to_disk_split(tiny_target: Path,
                                                        tmp_path: Path) -> None:
    """The ``chat`` column's from/value turns become prompts; each output row answers its own
    prompt, and a row the mapping leaves unreadable is skipped, not fatal."""
    prompts = [r["messages"][0]["content"] for r in chat_rows(3)]
    turns = [[{"from": "human", "value": p}, {"from": "gpt", "value": "old"}] for p in prompts]
    turns.append([{"from": "robot", "value": "unknown speaker"}, {"from": "gpt", "value": "x"}])
    folder = tmp_path / "ds"
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"chat": turns})}
                         ).save_to_disk(str(folder))
    out = tmp_path / "regen"
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "sparkforge.app.cli", "regenerate",
         "--data", f"{folder}:validation", "--data_column", "chat", "--output", str(out),
         "--engine.model", str(tiny_target), "--engine.max_model_len", "128",
         "--engine.dtype", "float32", "--engine.enforce_eager", "true", "--max_tokens", "6",
         "--progress", "false"], env=ENV, capture_output=True, text=True, timeout=600,
        start_new_session=True, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "unknown_role" in proc.stdout
    rows = pq.read_table(out / "part-000000.parquet").to_pylist()
    assert [r["source_row"] for r in rows] == [0, 1, 2]
    for row, prompt in zip(rows, prompts, strict=True):
        assert (row["messages"][0]["role"], row["messages"][0]["content"]) == ("user", prompt)
        assert row["messages"][-1]["role"] == "assistant"
        assert row["messages"][-1]["content"] != "old"
