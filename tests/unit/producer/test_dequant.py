"""FP8 block-scale and FP4/e8m0 dequantization equal an independent numpy bit-level decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkforge.producer.dequant import dequantize


def _e4m3(bits: np.ndarray) -> np.ndarray:
    """float8 e4m3fn from its bits: sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    normal = (1 + man / 8.0) * 2.0 ** (exp.astype(np.float64) - 7)
    return sign * np.where(exp == 0, man / 8.0 * 2.0 ** -6, normal)


def _e2m1(code: np.ndarray) -> np.ndarray:
    """e2m1 from its 4 bits: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = np.where(code & 0x8, -1.0, 1.0)
    exp, man = (code >> 1) & 0x3, code & 0x1
    return sign * np.where(exp == 0, man * 0.5, (1 + man / 2.0) * 2.0 ** (exp - 1.0))


def _blocks(scale: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    rows = np.arange(shape[0]) // block[0]
    cols = np.arange(shape[1]) // block[1]
    return scale[rows[:, None], cols[None, :]]


def test_fp8_e4m3_with_128_block_fp32_scales() -> None:
    """e4m3 [200, 300] with a [2, 3] fp32 grid (short last blocks) is bits * scale per block."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 256, (200, 300), dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x3C  # e4m3fn has no inf; 0x7F/0xFF are NaN
    scale = rng.uniform(0.01, 3.0, (2, 3)).astype(np.float32)
    weight = torch.from_numpy(bits).view(torch.float8_e4m3fn)
    ours = dequantize(weight, torch.from_numpy(scale), (128, 128)).numpy()
    expected = _e4m3(bits) * _blocks(scale, (200, 300), (128, 128))
    np.testing.assert_array_equal(ours, expected.astype(np.float32))


@pytest.mark.parametrize("scale_dtype", ["uint8", "float8_e8m0fnu"])
def test_fp4_e2m1_packed_with_e8m0_scales(scale_dtype: str) -> None:
    """Two e2m1 codes per byte (low nibble first) times 2**(b-127) per 1x32 block."""
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (4, 64), dtype=np.uint8)  # [4, 128] values
    exps = rng.integers(120, 135, (4, 4), dtype=np.uint8)
    scale = torch.from_numpy(exps)
    if scale_dtype != "uint8":
        scale = scale.view(torch.float8_e8m0fnu)
    ours = dequantize(torch.from_numpy(packed).view(torch.int8), scale).numpy()
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(4, 128)
    expected = _e2m1(codes) * _blocks(2.0 ** (exps.astype(np.float64) - 127), (4, 128), (1, 32))
    np.testing.assert_array_equal(ours, expected.astype(np.float32))


def test_scale_grid_larger_than_weight_is_refused() -> None:
    """A scale grid with more blocks than values is an error naming both shapes."""
    weight = torch.zeros(4, 4).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale grid \(8, 1\) does not fit a weight of \(4, 4\)"):
        dequantize(weight, torch.ones(8, 1))
    with pytest.raises(ValueError, match=r"in blocks of \(128, 128\)"):
        dequantize(torch.zeros(200, 300).to(torch.float8_e4m3fn), torch.ones(2, 2), (128, 128))
