"""MiniMax-M3 VL's image processor math in plain torch (its transformers class needs torchvision).

transformers' ``MiniMaxM3VLImageProcessor`` is a torchvision-backend processor: each image as a
uint8 CHW tensor is resized by ``smart_resize`` (both sides multiples of ``patch_size *
merge_size``, pixels within [``size.shortest_edge``, ``size.longest_edge``]) with antialiased
bicubic interpolation, rescaled and normalized in one step (``(x - 255 mean) / (255 std)`` in
float32) and cut into ``temporal_patch_size``-repeated patches grouped by ``merge_size`` blocks.
torchvision's uint8 bicubic resize on the CPU is torch's own antialiased uint8 interpolation
kernel; this module calls it directly, and does the rest with torch alone. The
equality with transformers' processor is checked against reference outputs it computed
(``tests/data/minimax_m3_vl_pixels.npz``; how to recompute them: ``tests/unit/shared/
test_minimax_vl_pixels.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """The resized (height, width): multiples of ``factor``, pixels in [min, max], aspect kept.

    Raises:
        ValueError: The aspect ratio exceeds 200.
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio must be at most 200, got {height}x{width}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True, kw_only=True)
class MiniMaxM3VLPixels:
    """The settings of a checkpoint's ``preprocessor_config.json`` that decide the pixels."""

    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 451584
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> MiniMaxM3VLPixels:
        """Read the settings (``size`` or the older ``min_pixels`` / ``max_pixels``)."""
        path = Path(model_dir) / "preprocessor_config.json"
        raw: Mapping[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
        found = raw.get("size")
        size: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        kwargs: dict[str, Any] = {
            "min_pixels": raw.get("min_pixels", size.get("shortest_edge", cls.min_pixels)),
            "max_pixels": raw.get("max_pixels", size.get("longest_edge", cls.max_pixels))}
        for name in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor"):
            if name in raw:
                kwargs[name] = raw[name]
        for name in ("image_mean", "image_std"):
            if name in raw:
                kwargs[name] = tuple(raw[name])
        return cls(**kwargs)

    def __call__(self, images: Sequence[Any]) -> dict[str, Any]:
        """``pixel_values`` [sum of patches, C * T * P * P] float32 and ``image_grid_thw``
        [N, 3] int64 of RGB PIL images, as the transformers processor returns them."""
        import torch

        patches, grids = [], []
        for image in images:
            uint8 = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
            resized = self._resize(uint8)
            normalized = self._normalize(resized)
            flat, grid_h, grid_w = self._patchify(normalized)
            patches.append(flat)
            grids.append([1, grid_h, grid_w])
        return {"pixel_values": torch.cat(patches, dim=0),
                "image_grid_thw": torch.tensor(grids, dtype=torch.long)}

    def num_tokens(self, grid_thw: Sequence[int]) -> int:
        """Image tokens of one image: its merged patches."""
        return int(np.prod(grid_thw)) // self.merge_size ** 2

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The size an image is resized to before patchifying.

        Raises:
            ValueError: The aspect ratio exceeds 200.
        """
        return smart_resize(height, width, factor=self.patch_size * self.merge_size,
                            min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def num_tokens_of_size(self, height: int, width: int) -> int:
        """Image tokens of a ``height`` x ``width`` image (see :meth:`resized`)."""
        new_h, new_w = self.resized(height, width)
        return self.num_tokens([1, new_h // self.patch_size, new_w // self.patch_size])

    def _resize(self, image: Any) -> Any:
        import torch

        height, width = image.shape[-2:]
        new_h, new_w = self.resized(height, width)
        if (new_h, new_w) == (height, width):
            return image
        # torch's own uint8 kernel, which torchvision's uint8 resize calls on the CPU (the
        # float32 kernel, clamped and rounded, is up to 16 levels off on sharp edges).
        return torch.nn.functional.interpolate(image[None].contiguous(), size=(new_h, new_w),
                                               mode="bicubic", align_corners=False,
                                               antialias=True)[0]

    def _normalize(self, image: Any) -> Any:
        import torch

        mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
        std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
        return (image.to(torch.float32) - mean[:, None, None]) / std[:, None, None]

    def _patchify(self, image: Any) -> tuple[Any, int, int]:
        channels, height, width = image.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        patches = image.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
        patches = patches.permute(1, 4, 2, 5, 0, 3, 6)   # [gh/m, gw/m, m, m, C, p, p]
        flat = (patches.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)
                .reshape(grid_h * grid_w, channels * t * p * p))
        return flat, grid_h, grid_w
