"""fp8 e4m3 quantisation of captured activations in torch, on whatever device holds them.

Same format as ``sparkforge.shared.dtypes.quantize_e4m3`` (the numpy reference the reader's
dequantiser mirrors): per-vector float32 scale ``absmax / 448`` (1.0 for an all-zero vector),
codes rounded to nearest even and saturated at +-448, the sign kept on zeros. Quantising where the
activations are (the GPU on inference nodes) halves the bytes moved to the host and runs at
memory speed; the numpy reference runs at tens of MB/s per core.
"""

from __future__ import annotations

import torch

from sparkforge.shared.dtypes import E4M3_MAX

QUANTIZE_ELEMENTS = 1 << 24
"""Values quantised per step: the float32 temporaries stay near 3 x 64 MiB, and the steps stay
large, since every torch op pays a fixed cost (its thread-pool barrier) however small it is."""


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise finite values over the last axis to e4m3 codes with a per-vector scale.

    Args:
        x: ``[..., H]`` finite values in their storage dtype (bf16 rounding already applied), on
            any device; widened to float32 exactly as the numpy reference widens stored values.

    Returns:
        ``(codes uint8 [..., H], scale float32 [...])`` on ``x``'s device, byte-identical to the
        numpy reference.
    """
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    flat_x, flat_codes = x.reshape(-1, x.shape[-1]), codes.view(-1, x.shape[-1])
    flat_scale = scale.view(-1)
    # A tensor divisor: CUDA divides by a Python scalar as a multiply by its rounded reciprocal,
    # which can differ from the reference's true division in the last bit.
    limit = torch.tensor(E4M3_MAX, dtype=torch.float32, device=x.device)
    step = max(1, QUANTIZE_ELEMENTS // max(1, x.shape[-1]))
    for start in range(0, flat_x.shape[0], step):
        rows = slice(start, start + step)
        block = flat_x[rows].float()
        absmax = block.abs().amax(dim=-1)
        block_scale = torch.where(absmax > 0, absmax / limit, torch.ones_like(absmax))
        # The cast rounds to nearest even; clamping first gives the reference's saturation
        # (an unclamped value past 464 would become NaN).
        y = (block / block_scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX)
        flat_codes[rows] = y.to(torch.float8_e4m3fn).view(torch.uint8)
        flat_scale[rows] = block_scale
    return codes, scale
