"""Only vllm_source (and the connector it loads) import vLLM; the other capture modules do not."""

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
    ],
)
def test_module_does_not_import_vllm(module: str) -> None:
    """Importing a non-vLLM capture module leaves vllm out of sys.modules."""
    code = f"import sys, {module}; print('vllm' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stderr
