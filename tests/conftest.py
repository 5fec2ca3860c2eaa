"""Shared fixtures: a tiny Qwen3-shaped target built locally (no downloads), an S3 emulator."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
# Each xdist worker (and the CLIs and engines it starts) gets its share of the cores for torch's
# intra-op threads: two workers of two threads each on two cores spin-wait on each other, which
# cost 5.8x the CPU on the torch-heavy trainer tests (290 s against 50 s, same files, same load).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer, H=128, head_dim=32, vocab-1024 Qwen3 target with a ChatML+generation template."""
    from sparkforge.app.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def tiny_v4_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer, H=64, hc_mult=2, vocab-1024 DeepSeek-V4 target (head.weight, hc_head)."""
    from sparkforge.app.tiny_target import build_tiny_deepseek_v4

    return build_tiny_deepseek_v4(tmp_path_factory.mktemp("tiny_v4"))


# A tiny V4 target's HF capture: 16 chat rows, every feature id [0, 3] (3 = L-1, the last layer),
# fp32, 1/4 held out.
V4_PRODUCER = {"backend": "hf", "layer_ids": [0, 1, 2, 3], "hidden_dtype": "float32",
               "rows_per_unit": 8, "shard_rows": 1024, "max_seq_len": 512, "eval_fraction": 0.25,
               "overlong": "truncate", "parity_samples": 0}


@pytest.fixture(scope="session")
def tiny_v4_cache(tmp_path_factory: pytest.TempPathFactory, tiny_v4_target: Path) -> Path:
    """``sparkforge produce`` of ``tiny_v4_target`` through the HF backend (V4_PRODUCER)."""
    import json

    import yaml

    from sparkforge.app.cli import main
    from sparkforge.app.tiny_text import demo_conversations

    root = tmp_path_factory.mktemp("tiny_v4_cache")
    rows = root / "chat.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in demo_conversations(16)))
    cache, producer = root / "cache", root / "producer.yaml"
    producer.write_text(yaml.safe_dump({**V4_PRODUCER, "data": str(rows), "output": str(cache),
                                        "engine": {"model": str(tiny_v4_target),
                                                   "dtype": "float32"}}))
    assert main(["produce", "--config", str(producer)]) == 0
    return cache


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Builds a tiny random target of a model type once per session: ``tiny_family("qwen3_moe")``.

    ``deepseek_v4`` is built as ``tiny_v4_target`` is, ``gemma4`` (the multimodal top level) by
    ``build_tiny_gemma4``; the others come from ``tiny_families``.
    """
    from tiny_families import build_tiny_family

    from sparkforge.app.tiny_target import build_tiny_deepseek_v4, build_tiny_gemma4

    built: dict[str, Path] = {}

    def build(model_type: str) -> Path:
        if model_type not in built:
            out = tmp_path_factory.mktemp(f"tiny_{model_type}")
            if model_type == "deepseek_v4":
                built[model_type] = build_tiny_deepseek_v4(out)
            elif model_type == "gemma4":
                built[model_type] = build_tiny_gemma4(out, multimodal=True)
            else:
                built[model_type] = build_tiny_family(out, model_type)
        return built[model_type]

    return build


@pytest.fixture(scope="session")
def tiny_target_plain_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same target whose chat template has no {% generation %} markers."""
    from sparkforge.app.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny_plain"), generation_markers=False)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[dict[str, Any]]:
    """A real S3 emulator (moto) on 127.0.0.1 with bucket ``sparkforge-test``.

    Yields ``{"endpoint": url, "bucket": name, "storage_options": {...}}``; pass the options to
    any fsspec/s3fs call or sparkforge ``storage_options`` argument.
    """
    # A separate process, not in this one: importing Flask here leaves LocalProxy globals in
    # sys.modules whose hasattr() raises RuntimeError, which breaks vLLM's start-up scan of
    # loaded modules (vllm/triton_utils/dispatcher.py) for any later in-process engine.
    server = subprocess.Popen([sys.executable, "-P", str(Path(__file__).with_name("s3_server.py"))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    assert server.stdin is not None
    port = server.stdout.readline().strip()
    if not port.isdigit():
        server.kill()
        raise RuntimeError(f"the S3 server did not start (printed {port!r})")
    endpoint = f"http://127.0.0.1:{port}"
    options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint,
               "client_kwargs": {"region_name": "us-east-1"}}
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing",
                 ).create_bucket(Bucket="sparkforge-test")
    try:
        yield {"endpoint": endpoint, "bucket": "sparkforge-test", "storage_options": options}
    finally:
        server.stdin.close()
        server.wait(timeout=30)


@pytest.fixture(scope="session")
def tiny_cache(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A finalized bf16 cache (16 samples, 4 units, 4 eval) of the tiny target, on local disk."""
    from cache_helpers import write_tiny_cache

    return write_tiny_cache(str(tmp_path_factory.mktemp("tiny_cache") / "cache"), tiny_target)
