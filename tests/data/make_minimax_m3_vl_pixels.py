"""Write ``minimax_m3_vl_pixels.npz``: transformers' MiniMax-M3 VL image processor on fixed images.

The processor needs torchvision, which the CPU install cannot import, so this runs once in a
throwaway venv (x86_64: ``python3.11 -m venv /tmp/tvref && /tmp/tvref/bin/python -m pip install
torch==2.14.1 torchvision==0.29.1 transformers==5.19.0 pillow numpy``, then
``/tmp/tvref/bin/python tests/data/make_minimax_m3_vl_pixels.py``). The test
``tests/unit/shared/test_minimax_vl_pixels.py`` compares sparkforge's torch-only processing with it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import transformers
from PIL import Image
from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import (
    MiniMaxM3VLImageProcessor,
)

SIZES = ((20, 28), (9, 30), (61, 100))
"""(height, width) of the noise images; with a smooth 90 x 140 and 333 x 500 one, each setting
upscales (to min_pixels), keeps and (the tiny one, max 48 x 48) downscales."""
SETTINGS = {"default": {},
            "tiny": {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
                     "min_pixels": 16 * 16, "max_pixels": 48 * 48}}


def _smooth(height: int, width: int) -> np.ndarray:
    """A gradient with a sharp stripe pattern: bicubic overshoot and clamping show on edges."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // (width - 1), y * 255 // (height - 1), ((x + y) % 37) * 6],
                    axis=-1).astype(np.uint8)


def main() -> None:
    rng = np.random.default_rng(0)
    arrays = {f"image_{i}": rng.integers(0, 256, (*size, 3), dtype=np.uint8)
              for i, size in enumerate(SIZES)}
    arrays[f"image_{len(SIZES)}"] = _smooth(90, 140)
    arrays["large"] = _smooth(333, 500)
    out: dict[str, np.ndarray] = dict(arrays)
    for name, kwargs in SETTINGS.items():
        names = [f"image_{i}" for i in range(len(SIZES) + 1)] + (["large"] if kwargs else [])
        processor = MiniMaxM3VLImageProcessor(**kwargs)
        result = processor(images=[Image.fromarray(arrays[n]) for n in names],
                           return_tensors="pt")
        out[f"{name}_pixel_values"] = result["pixel_values"].numpy()
        out[f"{name}_image_grid_thw"] = result["image_grid_thw"].numpy()
    out["transformers_version"] = np.array(transformers.__version__)
    np.savez_compressed(Path(__file__).with_name("minimax_m3_vl_pixels.npz"), **out)


if __name__ == "__main__":
    main()
