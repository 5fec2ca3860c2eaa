"""GPU: activations are converted and fp8-quantised on the device and cross to the host once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparkforge.producer.capture import to_storage
from sparkforge.producer.source import CaptureResult
from sparkforge.shared import dtypes

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class DeviceToHostCopies(TorchDispatchMode):
    """Counts copies whose source is on CUDA and destination on the host, with their bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default and args[1].is_cuda and not args[0].is_cuda:
            self.copies.append(args[0].numel() * args[0].element_size())
        elif func is torch.ops.aten._to_copy.default and args[0].is_cuda and not out.is_cuda:
            self.copies.append(out.numel() * out.element_size())
        return out


@pytest.mark.parametrize("aux_codec", ["lossless", "fp8"])
def test_one_device_to_host_copy_per_array_of_stored_bytes(aux_codec: str) -> None:
    """fp8 codes + scales (or bf16 aux) and bf16 final each cross once, at their stored size."""
    t, f, h = 300, 3, 256
    aux = torch.randn(t, f, h, device="cuda", dtype=torch.float32)
    final = torch.randn(t, h, device="cuda", dtype=torch.float32)
    result = CaptureResult(sample_id=0, aux_hidden=aux, final_hidden=final)
    with DeviceToHostCopies() as counter:
        aux_out, scale, final_out = to_storage(result, "bfloat16", aux_codec)
    aux_bytes = t * f * h * (1 if aux_codec == "fp8" else 2)
    expected = [t * h * 2, aux_bytes] + ([t * f * 4] if aux_codec == "fp8" else [])
    assert sorted(counter.copies) == sorted(expected)
    bits = dtypes.float_to_storage(aux.cpu().numpy(), "bfloat16")
    if aux_codec == "fp8":
        codes, ref_scale = dtypes.quantize_e4m3(dtypes.storage_to_float32(bits, "bfloat16"))
        np.testing.assert_array_equal(aux_out, codes)  # the device's bytes are the reference's
        np.testing.assert_array_equal(scale, ref_scale)
    else:
        np.testing.assert_array_equal(aux_out, bits)
    np.testing.assert_array_equal(final_out, dtypes.float_to_storage(final.cpu().numpy(),
                                                                     "bfloat16"))
