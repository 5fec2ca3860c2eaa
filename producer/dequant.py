"""Exact dequantization of block-scaled FP8 and FP4 checkpoint tensors to fp32.

FP8 weights are ``float8_e4m3fn`` (or e5m2) with one scale per block, typically 128x128. FP4 weights
pack two e2m1 values per byte (low nibble first) in ``int8`` / ``uint8`` / ``float4_e2m1fn_x2``,
typically with one scale per 1x32 block. Scales are fp32, or e8m0 (``float8_e8m0fnu``, or raw
``uint8`` exponents meaning ``2 ** (b - 127)``). The block shape is the checkpoint's
``weight_block_size`` when given (the last block of an axis may then be short), else the weight
must divide evenly into the scale grid.
"""

from __future__ import annotations

import torch

from sparkforge.shared.errors import SparkforgeError

FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
FP4_PACKED = frozenset({torch.int8, torch.uint8, torch.float4_e2m1fn_x2})
# The 16 e2m1 codes: sign bit, 2 exponent bits (bias 1), 1 mantissa bit.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_quantized(tensor: torch.Tensor) -> bool:
    """True for the FP8 and packed-FP4 dtypes this module reads."""
    return tensor.dtype in FP8 or tensor.dtype in FP4_PACKED


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes of two e2m1 codes each -> ``[..., 2n]`` fp32 (low nibble first)."""
    codes = packed.contiguous().view(torch.uint8).long()
    table = torch.tensor(_E2M1, dtype=torch.float32)
    pairs = torch.stack([table[codes & 0xF], table[(codes >> 4) & 0xF]], dim=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scales as fp32: e8m0 codes (``uint8`` or ``float8_e8m0fnu``) become ``2 ** (b - 127)``."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...] | None = None
) -> torch.Tensor:
    """``weight * scale`` per block, in fp32.

    Args:
        weight: FP8, or packed FP4 (the last axis holds two values per byte).
        scale: One scale per block, or a single scale.
        block: Block shape (e.g. ``(128, 128)``); None derives it from an even division.

    Raises:
        ValueError: When the scale grid does not fit the weight and block shape.
    """
    values = unpack_fp4(weight) if weight.dtype in FP4_PACKED else weight.float()
    scales = scale_values(scale)
    if scales.numel() == 1:
        return values * scales.reshape(())
    sizes = block or tuple(n // s if s and n % s == 0 else 0
                           for n, s in zip(values.shape, scales.shape, strict=False))
    if (scales.dim() != values.dim() or len(sizes) != values.dim()
            or any(b <= 0 or -(-n // b) != s
                   for n, s, b in zip(values.shape, scales.shape, sizes, strict=False))):
        raise SparkforgeError(
            f"scale grid {tuple(scales.shape)} does not fit a weight of "
            f"{tuple(values.shape)} values in blocks of {block or 'an even division'}")
    for axis, (n, b) in enumerate(zip(values.shape, sizes, strict=True)):
        scales = scales.repeat_interleave(b, dim=axis).narrow(axis, 0, n)
    return values * scales
