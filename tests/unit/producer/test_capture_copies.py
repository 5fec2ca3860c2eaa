"""Capture-side copies on the host: results already on the host reach the records uncopied."""

from __future__ import annotations

import numpy as np
import torch

from sparkforge.producer.capture import to_storage
from sparkforge.producer.source import CaptureResult


def test_host_bf16_results_become_records_without_a_copy() -> None:
    """bf16 host tensors (the vLLM path) are viewed as the stored uint16 bits, not copied."""
    aux = torch.randn(7, 2, 16).to(torch.bfloat16)
    final = torch.randn(7, 16).to(torch.bfloat16)
    stored_aux, scale, stored_final = to_storage(
        CaptureResult(sample_id=0, aux_hidden=aux, final_hidden=final), "bfloat16", "lossless")
    assert scale is None
    assert np.shares_memory(stored_aux, aux.view(torch.int16).numpy())
    assert np.shares_memory(stored_final, final.view(torch.int16).numpy())
    np.testing.assert_array_equal(stored_aux, aux.view(torch.int16).numpy().view(np.uint16))


def test_fp8_records_hold_codes_and_scales_from_torch() -> None:
    """fp8 mode returns uint8 codes [T, F, H] and float32 scales [T, F] for the writer."""
    aux = torch.randn(5, 3, 8).to(torch.bfloat16)
    codes, scale, _ = to_storage(
        CaptureResult(sample_id=0, aux_hidden=aux, final_hidden=torch.zeros(5, 8)), "bfloat16",
        "fp8")
    assert codes.dtype == np.uint8
    assert codes.shape == (5, 3, 8)
    assert scale is not None
    assert scale.dtype == np.float32
    assert scale.shape == (5, 3)
    np.testing.assert_allclose(scale, aux.float().abs().amax(-1).numpy() / 448, rtol=1e-6)
