"""Only vllm_source (and the connector and CPU memory sizing it loads) import vLLM; the other
capture modules do not."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    [
        "sparkforge.producer.hf_source",
        "sparkforge.producer.parity",
        "sparkforge.producer.payload",
        "sparkforge.shared.layer_ids",
        "sparkforge.producer.target_head",
        "sparkforge.producer.dequant",
        "sparkforge.producer.target_files",
    ],
)
def test_module_does_not_import_vllm(module: str) -> None:
    """Importing a non-vLLM capture module leaves vllm out of sys.modules."""
    code = f"import sys, {module}; print('vllm' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stderr


def test_quantization_passes_through_to_vllm() -> None:
    """An FP8/FP4 checkpoint runs as-is: the engine's quantization reaches vllm.LLM unchanged."""
    from sparkforge.producer.engine_options import EngineOptions
    from sparkforge.producer.vllm_source import engine_kwargs

    for quantization in ("fp8", "modelopt_fp4", None):
        kwargs = engine_kwargs(EngineOptions(model="m", quantization=quantization))
        assert kwargs["quantization"] == quantization
