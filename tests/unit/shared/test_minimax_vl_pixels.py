"""sparkforge's torch-only MiniMax-M3 VL image processing equals transformers' processor.

The reference outputs were computed by transformers 5.19's ``MiniMaxM3VLImageProcessor`` (with
torchvision 0.29.1 on torch 2.14.1, in a throwaway venv: the CPU install cannot import
torchvision) on the images stored beside them; ``tests/data/make_minimax_m3_vl_pixels.py`` says
how to recompute them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sparkforge.shared.minimax_vl_pixels import MiniMaxM3VLPixels, smart_resize

DATA = Path(__file__).parents[2] / "data" / "minimax_m3_vl_pixels.npz"
SETTINGS = {"default": MiniMaxM3VLPixels(),
            "tiny": MiniMaxM3VLPixels(patch_size=4, merge_size=2, temporal_patch_size=2,
                                      min_pixels=16 * 16, max_pixels=48 * 48)}


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(DATA) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_pixels_equal_the_transformers_processor(reference: dict[str, np.ndarray],
                                                 setting: str) -> None:
    """Resize, rescale + normalize and patchify give transformers' pixel values (fp32, 1e-5)
    and grids, for images that are upscaled, kept and (tiny setting) downscaled."""
    names = sorted(k for k in reference if k.startswith("image_")) + (
        ["large"] if setting == "tiny" else [])
    got = SETTINGS[setting]([Image.fromarray(reference[n]) for n in names])
    want = torch.from_numpy(reference[f"{setting}_pixel_values"])
    assert got["image_grid_thw"].tolist() == reference[f"{setting}_image_grid_thw"].tolist()
    assert got["pixel_values"].shape == want.shape
    assert float((got["pixel_values"] - want).abs().max()) <= 1e-5


def test_smart_resize_keeps_multiples_and_the_pixel_range() -> None:
    """Both sides are multiples of the factor and the area lies within [min, max]."""
    for height, width in ((20, 28), (9, 30), (1000, 700), (28, 28)):
        h, w = smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 64)
        assert h % 28 == 0
        assert w % 28 == 0
        assert 56 * 56 <= h * w <= 28 * 28 * 64
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300, factor=28, min_pixels=1, max_pixels=10**6)
