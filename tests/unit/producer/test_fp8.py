"""fp8 in torch (where the activations are) against the numpy reference: the same bytes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from cache_helpers import SMALL_FP8_SPEC, make_run_header, make_unit

from sparkforge.producer import fp8
from sparkforge.producer.fp8 import quantize_e4m3
from sparkforge.shared import dtypes
from sparkforge.shared.writer import CacheWriter


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def _reference(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return dtypes.quantize_e4m3(dtypes.storage_to_float32(bits, "bfloat16"))


def test_codes_and_scales_match_numpy_reference_bit_for_bit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Token norms over 30 octaves, zeros, -0, several quantisation steps: identical bytes."""
    monkeypatch.setattr(fp8, "QUANTIZE_ELEMENTS", 16 * 64)  # 16 rows per step
    rng = np.random.default_rng(0)
    t = 333
    x = rng.standard_normal((t, 3, 64)) * np.exp2(rng.uniform(-20, 10, (t, 3, 1)))
    x[5, 1] = 0.0
    x[6, 0, :3] = -0.0
    x[7, 2, 0] = 1e4  # a massive activation: the other channels fall into subnormal codes
    bits = dtypes.float_to_storage(x.astype(np.float32), "bfloat16")
    codes, scale = quantize_e4m3(_bf16(bits))
    want_codes, want_scale = _reference(bits)
    assert codes.dtype == torch.uint8
    assert scale.dtype == torch.float32
    np.testing.assert_array_equal(codes.numpy(), want_codes)
    np.testing.assert_array_equal(scale.numpy().view(np.uint32), want_scale.view(np.uint32))


def test_ties_round_to_even_and_saturate_like_numpy() -> None:
    """Every midpoint between e4m3 codes (both signs) and values just past 448 agree."""
    codes_values = dtypes.e4m3_values()[:127]
    mids = (codes_values[:-1] + codes_values[1:]) / 2
    row = np.concatenate([mids, -mids, codes_values, [448.0, -448.0]]).astype(np.float32)
    got, _ = quantize_e4m3(torch.from_numpy(row[None]))
    want, _ = dtypes.quantize_e4m3(row[None])
    np.testing.assert_array_equal(got.numpy(), want)
    over = np.array([[448.0, 300.0, -464.0]], dtype=np.float32)  # absmax 464: 448 after scaling
    np.testing.assert_array_equal(quantize_e4m3(torch.from_numpy(over))[0].numpy(),
                                  dtypes.quantize_e4m3(over)[0])


def test_stored_shards_are_byte_identical_to_the_numpy_path(tmp_path: Path) -> None:
    """A unit quantised in torch writes the same shard objects as the writer's numpy path."""
    spec = SMALL_FP8_SPEC
    samples, accounting = make_unit(spec, 0)
    quantized = []
    for s in samples:
        codes, scale = quantize_e4m3(_bf16(s.aux_hidden))
        quantized.append(dataclasses.replace(s, aux_hidden=codes.numpy(), aux_scale=scale.numpy()))
    for name, unit in (("numpy", samples), ("torch", quantized)):
        CacheWriter.open(str(tmp_path / name), spec=spec,
                         header=make_run_header(spec)).write_unit(0, unit, accounting)
    for array in ("aux_hidden.0", "aux_hidden.1", "aux_scale.0", "aux_scale.1"):
        objects = sorted(p.relative_to(tmp_path / "numpy")
                         for p in (tmp_path / "numpy" / array).rglob("*") if p.is_file())
        assert any(p.parts[1] == "c" for p in objects), objects  # shard objects exist
        for rel in objects:
            want = (tmp_path / "numpy" / rel).read_bytes()
            assert (tmp_path / "torch" / rel).read_bytes() == want, rel
