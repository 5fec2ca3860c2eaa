"""Shared fixtures: a tiny Qwen3-shaped target built locally (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer, H=128, head_dim=32, vocab-1024 Qwen3 target with a ChatML+generation template."""
    from sparkforge.producer.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def tiny_target_plain_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same target whose chat template has no {% generation %} markers."""
    from sparkforge.producer.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny_plain"), generation_markers=False)
