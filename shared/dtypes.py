"""Hidden-state dtypes: bf16 as uint16 bits, float32 <-> storage conversion, fp8 e4m3 codes."""

from __future__ import annotations

from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from sparkforge.shared.errors import SparkforgeError

HiddenDtype = Literal["bfloat16", "float16", "float32"]
STORAGE_DTYPES: Final[dict[str, np.dtype[np.generic]]] = {
    "bfloat16": np.dtype(np.uint16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
}
E4M3_MAX: Final = 448.0
"""Largest finite float8 e4m3fn value; the per-token scale maps absmax onto it."""


def float_to_storage(x: npt.NDArray[np.floating], hidden_dtype: str) -> npt.NDArray[np.generic]:
    """Convert float values to the storage dtype (bf16: round-to-nearest-even uint16 bits)."""
    if hidden_dtype == "bfloat16":
        bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        rounded = bits + (((bits >> 16) & 1) + 0x7FFF).astype(np.uint32)
        out = (rounded >> 16).astype(np.uint16)
        nan = np.isnan(x)
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # keep NaN a quiet NaN
        return out
    if hidden_dtype in STORAGE_DTYPES:
        return np.asarray(x, dtype=STORAGE_DTYPES[hidden_dtype])
    raise SparkforgeError(
        f"hidden_dtype must be one of {sorted(STORAGE_DTYPES)}, got {hidden_dtype!r}")


def non_finite(x: npt.NDArray[np.generic], hidden_dtype: str) -> npt.NDArray[np.bool_]:
    """True where a stored hidden value is NaN or infinite (bf16 bits: exponent all ones)."""
    if hidden_dtype == "bfloat16":
        exponent = np.asarray(x, dtype=np.uint16) & np.uint16(0x7F80)
        return np.asarray(exponent == 0x7F80)
    return np.asarray(~np.isfinite(x), dtype=np.bool_)


def storage_to_float32(x: npt.NDArray[np.generic], hidden_dtype: str) -> npt.NDArray[np.float32]:
    """Exact widening of stored values to float32 (bf16 bits shift into the high half)."""
    if hidden_dtype == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(x, dtype=np.float32)


def e4m3_values() -> npt.NDArray[np.float32]:
    """The value of each of the 256 float8 e4m3fn codes (NaN for 0x7F and 0xFF)."""
    codes = np.arange(256, dtype=np.int64)
    exponent, mantissa = (codes >> 3) & 0xF, (codes & 7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = mantissa / 8.0 * 2.0**-6
    magnitude = np.where(exponent == 0, subnormal, normal)
    values = np.where(codes >> 7 == 1, -magnitude, magnitude)
    values[[0x7F, 0xFF]] = np.nan
    return values.astype(np.float32)


_E4M3: Final = e4m3_values()
_MIDPOINTS: Final = (_E4M3[:126] + _E4M3[1:127]) / 2  # between consecutive positive codes


def quantize_e4m3(
    x: npt.NDArray[np.float32],
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    """Per-vector fp8 e4m3 quantisation over the last axis, round-to-nearest-even.

    Returns:
        ``(codes, scale)``: uint8 codes shaped like ``x`` and float32 scales ``x.shape[:-1]``
        with ``x ~= e4m3(codes) * scale`` (scale = absmax / 448; 1.0 for all-zero vectors).
    """
    absmax = np.max(np.abs(x), axis=-1)
    scale = np.where(absmax > 0, absmax / np.float32(E4M3_MAX), 1.0).astype(np.float32)
    y = x / scale[..., None]
    mag = np.minimum(np.abs(y), np.float32(E4M3_MAX))
    idx = np.searchsorted(_MIDPOINTS, mag, side="left")
    tie = (idx < 126) & (mag == _MIDPOINTS[np.minimum(idx, 125)]) & (idx % 2 == 1)
    idx = idx + tie
    codes = (idx | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8)
    return codes, scale


def dequantize_e4m3(
    codes: npt.NDArray[np.uint8], scale: npt.NDArray[np.float32]
) -> npt.NDArray[np.float32]:
    """Inverse of :func:`quantize_e4m3`."""
    out: npt.NDArray[np.float32] = _E4M3[codes] * scale[..., None]
    return out
