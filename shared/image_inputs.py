"""A vision-language target's own image processing: pixel values and placeholder expansion.

The chat template renders one image token per image part; this module runs the target's image
processor (loaded from the checkpoint's ``preprocessor_config.json``) on the decoded images and
expands each image token into the span the model's forward fills with image features, exactly as
the target's transformers processor does. The producer and ``sparkforge eval`` both use it, so
captured rows and eval prompts see the images as the target serves them.

Gemma4 (``gemma4``): transformers' ``Gemma4ImageProcessorPil`` (PIL, no torchvision), and
``Gemma4Processor``'s expansion ``boi + image * num_soft_tokens + eoi``; ``mm_token_type_ids`` is
1 on the image tokens (the bidirectional vision attention reads it). ``Gemma4Processor`` itself
cannot be built here: its module imports the torchvision image processor.

MiniMax-M3 VL (``minimax_m3_vl``): its image processor's math in torch
(``sparkforge.shared.minimax_vl_pixels``; transformers' class needs torchvision), and
``MiniMaxM3VLProcessor``'s expansion ``start + image * (merged patches) + end`` with the
tokenizer's ``]<]start of image[>[`` / ``]<]end of image[>[`` tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparkforge.shared.images import ImageProblem, LoadedImages

logger = logging.getLogger(__name__)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


@dataclass(frozen=True, kw_only=True)
class VisionFamily:
    """How one VL top level turns images into model inputs."""

    model_type: str
    processor: str
    """Name recorded in the manifest: the transformers image processor class whose math runs."""
    token_types: bool
    """The forward takes ``mm_token_type_ids`` (1 on image tokens)."""


VISION_FAMILIES = {
    "gemma4": VisionFamily(model_type="gemma4", processor="Gemma4ImageProcessorPil",
                           token_types=True),
    "minimax_m3_vl": VisionFamily(model_type="minimax_m3_vl",
                                  processor="MiniMaxM3VLImageProcessor", token_types=False),
}
MINIMAX_VISION_TOKENS = ("]<]start of image[>[", "]<]end of image[>[")
"""MiniMax-M3 VL's begin- and end-of-image tokens (``MiniMaxM3VLProcessor``)."""


@dataclass(frozen=True, kw_only=True)
class ImageRow:
    """A row's token ids and loss mask after placeholder expansion, and its forward inputs."""

    input_ids: np.ndarray
    """[T] int32."""
    loss_mask: np.ndarray
    """[T] uint8, 0 on every image span (boi, image tokens, eoi)."""
    model_inputs: dict[str, Any]
    """Extra forward kwargs for the one-row forward: ``pixel_values``, ``image_position_ids``,
    ``mm_token_type_ids`` (batch dimension 1 where the model wants one)."""
    images_sha256: str


class TargetImages:
    """The image processing of one VL target checkpoint."""

    def __init__(self, model_dir: str | Path, config: Mapping[str, Any]) -> None:
        self.family = VISION_FAMILIES[str(config["model_type"])]
        self.config_sha256 = _processor_config_sha256(Path(model_dir))
        if self.family.model_type == "gemma4":
            from transformers.models.gemma4.image_processing_pil_gemma4 import (
                Gemma4ImageProcessorPil,
            )

            self._gemma4 = Gemma4ImageProcessorPil.from_pretrained(str(model_dir))
            self._positions = int(config.get("vision_config", {}).get(
                "position_embedding_size", 1 << 62))
            self.image_token_id = int(config["image_token_id"])
            self.boi_token_id = int(config["boi_token_id"])
            self.eoi_token_id = int(config["eoi_token_id"])
        else:
            from transformers import AutoTokenizer

            from sparkforge.shared.minimax_vl_pixels import MiniMaxM3VLPixels

            self._minimax = MiniMaxM3VLPixels.from_pretrained(model_dir)
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            self.image_token_id = int(config.get("image_token_index",
                                                 config.get("image_token_id", -1)))
            boi, eoi = MINIMAX_VISION_TOKENS
            self.boi_token_id = int(tokenizer.convert_tokens_to_ids(boi))  # type: ignore[arg-type]
            self.eoi_token_id = int(tokenizer.convert_tokens_to_ids(eoi))  # type: ignore[arg-type]

    def pixels(self, images: Sequence[Any]) -> tuple[dict[str, Any], list[int]]:
        """The processor's forward inputs of ``images`` and each image's number of tokens."""
        if self.family.model_type == "gemma4":
            out = self._gemma4(images=list(images), return_tensors="pt")
            return ({"pixel_values": out["pixel_values"],
                     "image_position_ids": out["image_position_ids"]},
                    [int(n) for n in out["num_soft_tokens_per_image"]])
        got = self._minimax(images)
        return got, [self._minimax.num_tokens(g) for g in got["image_grid_thw"].tolist()]

    def num_tokens(self, width: int, height: int) -> int | ImageProblem:
        """Image tokens of a ``width`` x ``height`` image, computed from its size alone as the
        processor sizes it; ``SHAPE_UNSUPPORTED`` for a size it cannot take."""
        try:
            if self.family.model_type == "gemma4":
                return self._gemma4_tokens(width, height)
            return self._minimax.num_tokens_of_size(height, width)
        except ValueError as exc:  # the processor's own refusal (aspect ratio, ...)
            logger.warning("image of %d x %d refused: %s", width, height, exc)
            return ImageProblem.SHAPE_UNSUPPORTED

    def _gemma4_tokens(self, width: int, height: int) -> int | ImageProblem:
        from transformers.models.gemma4.image_processing_pil_gemma4 import (
            get_aspect_ratio_preserving_size,
        )

        proc = self._gemma4
        max_patches = proc.max_soft_tokens * proc.pooling_kernel_size ** 2
        resized = (get_aspect_ratio_preserving_size(
            height=height, width=width, patch_size=proc.patch_size, max_patches=max_patches,
            pooling_kernel_size=proc.pooling_kernel_size) if proc.do_resize else (height, width))
        rows, cols = (side // proc.patch_size for side in resized)
        # The vision tower looks each patch's column and row up in a table of this many.
        if max(rows, cols) > self._positions or rows * cols > max_patches:
            logger.warning("image of %d x %d refused: its %d x %d patch grid does not fit the "
                           "vision tower (at most %d patches per side, %d in all)", width, height,
                           cols, rows, self._positions, max_patches)
            return ImageProblem.SHAPE_UNSUPPORTED
        return rows * cols // proc.pooling_kernel_size ** 2

    def identity(self) -> dict[str, Any]:
        """What the manifest records about the image processing."""
        return {"processor": self.family.processor,
                "processor_config_sha256": self.config_sha256,
                "image_token_id": self.image_token_id}

    def expand(
        self, input_ids: np.ndarray, loss_mask: np.ndarray, images: LoadedImages
    ) -> ImageRow | ImageProblem:
        """Pixel values of ``images`` and the ids with each image token expanded to its span.

        Returns ``TOO_MANY`` when the rendering holds another number of image tokens than there
        are images (a template that drops or repeats image parts), ``SHAPE_UNSUPPORTED`` for
        an image the processing cannot take and ``PROCESSING_FAILED`` when the processor raises.
        """
        slots = np.flatnonzero(input_ids == self.image_token_id)
        if slots.size != len(images.images):
            return ImageProblem.TOO_MANY
        expected = [self.num_tokens(*image.size) for image in images.images]
        for n in expected:
            if isinstance(n, ImageProblem):
                return n
        try:
            inputs, counts = self.pixels(images.images)
        except Exception as exc:  # noqa: BLE001 - one row's images, counted as its skip reason
            logger.warning("image processor failed on a row: %s: %s", type(exc).__name__, exc)
            return ImageProblem.PROCESSING_FAILED
        if counts != expected:  # would mean num_tokens no longer follows the processor
            logger.warning("image processor gave %s image tokens, expected %s", counts, expected)
            return ImageProblem.PROCESSING_FAILED
        ids_parts, mask_parts, start = [], [], 0
        for slot, n in zip(slots.tolist(), counts, strict=True):
            ids_parts += [input_ids[start:slot],
                          np.asarray([self.boi_token_id, *[self.image_token_id] * n,
                                      self.eoi_token_id], dtype=np.int32)]
            mask_parts += [loss_mask[start:slot], np.zeros(n + 2, dtype=np.uint8)]
            start = slot + 1
        ids = np.concatenate([*ids_parts, input_ids[start:]]).astype(np.int32)
        mask = np.concatenate([*mask_parts, loss_mask[start:]]).astype(np.uint8)
        return ImageRow(input_ids=ids, loss_mask=mask, images_sha256=images.sha256,
                        model_inputs={**inputs, **self.token_types(ids)})

    def token_types(self, input_ids: np.ndarray | Any) -> dict[str, Any]:
        """``mm_token_type_ids`` [1, T] of a row's ids (numpy or torch), 1 on image tokens, for a
        family whose forward reads them (else nothing)."""
        import torch

        if not self.family.token_types:
            return {}
        ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64)).view(1, -1)
        return {"mm_token_type_ids": (ids == self.image_token_id).long()}


def _processor_config_sha256(model_dir: Path) -> str:
    """sha256 of the checkpoint's processor config files (canonical JSON, in file order)."""
    digest = hashlib.sha256()
    for name in PROCESSOR_FILES:
        path = model_dir / name
        if path.is_file():
            digest.update(name.encode())
            digest.update(json.dumps(json.loads(path.read_text()), sort_keys=True).encode())
    return digest.hexdigest()


def target_images(model_dir: str | Path, config: Mapping[str, Any]) -> TargetImages | None:
    """The target's image processing, or None for a text-only target (or a VL top level whose
    processor does not run here, or a checkpoint without a processor config)."""
    if config.get("model_type") not in VISION_FAMILIES or not any(
            (Path(model_dir) / name).is_file() for name in PROCESSOR_FILES):
        return None
    return TargetImages(model_dir, config)
