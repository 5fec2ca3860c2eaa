"""Hidden dtype conversions and fp8 e4m3 quantisation against independent references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkforge.shared.dtypes import (
    dequantize_e4m3,
    float_to_storage,
    quantize_e4m3,
    storage_to_float32,
)


def _values() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * rng.uniform(1e-3, 1e3, 4096)).astype(np.float32)
    return np.concatenate([x, np.float32([0.0, -0.0, 1.0, 3.0e38, -1e-40, np.inf, -np.inf])])


def test_bf16_bits_match_torch_rounding() -> None:
    """float_to_storage('bfloat16') rounds exactly like torch's float32 -> bfloat16 cast."""
    x = _values()
    ours = float_to_storage(x, "bfloat16")
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, ref)
    np.testing.assert_array_equal(storage_to_float32(ours, "bfloat16"),
                                  torch.from_numpy(x).to(torch.bfloat16).float().numpy())


def test_fp8_codes_match_torch_e4m3fn() -> None:
    """quantize_e4m3 produces the same codes as torch's float8_e4m3fn cast of x / scale."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 3, 128)) * rng.uniform(0.1, 50, (64, 3, 1))).astype(np.float32)
    codes, scale = quantize_e4m3(x)
    ref = torch.from_numpy(x / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(codes, ref)


def test_fp8_error_matches_hand_computation_and_bound() -> None:
    """Dequantised values equal a brute-force nearest-e4m3 hand computation; rel-L2 ~2.6%."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((256, 2, 64)) * rng.uniform(0.5, 9.0, (256, 2, 1))).astype(np.float32)
    # Hand computation: all finite e4m3 magnitudes from the format definition, nearest wins.
    grid = sorted({(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)
                   if not (e == 15 and m == 7)} | {m / 8 * 2.0**-6 for m in range(8)})
    grid_np = np.array(grid)
    scale = np.abs(x).max(-1, keepdims=True) / 448.0
    y = np.abs(x / scale)
    nearest = grid_np[np.abs(y[..., None] - grid_np).argmin(-1)]
    hand = np.sign(x) * nearest * scale
    ours = dequantize_e4m3(*quantize_e4m3(x))
    ties = np.isclose(np.abs(y[..., None] - grid_np), np.abs(y - nearest)[..., None]).sum(-1) > 1
    np.testing.assert_allclose(ours[~ties], hand[~ties], rtol=1e-6)
    rel = np.linalg.norm(ours - x, axis=-1) / np.linalg.norm(x, axis=-1)
    assert 0.015 < rel.mean() < 0.03, rel.mean()
    assert rel.max() < 0.045


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_native_dtypes_are_plain_casts(dtype: str) -> None:
    """float16/float32 storage is a plain numpy cast."""
    x = _values()[:100]
    assert float_to_storage(x, dtype).dtype == np.dtype(dtype)


def test_unknown_hidden_dtype_is_named() -> None:
    """An unknown dtype raises naming the value."""
    with pytest.raises(ValueError, match="int8"):
        float_to_storage(np.zeros(3, np.float32), "int8")
