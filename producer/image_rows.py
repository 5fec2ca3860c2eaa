"""Chat rows with images for a vision-language target: load the images, expand the placeholders.

:class:`ImageChatEncoder` is a :class:`ChatEncoder` whose rows may carry image parts: they reach
the template as ``{"type": "image"}`` parts (one image token each). An image row's images are read
under the run's allow-list and limits (``sparkforge.shared.image_sources``), checked against the
pixel limit and decoded; the target's own image processing gives the pixel values and expands
each image token into its span. Image spans are never supervised (loss mask 0) but stay in the
row as context. A bad image skips the row with its own reason
(``sparkforge.shared.images.ImageProblem``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sparkforge.producer.chat import ChatEncoder, Encoded, SkipReason
from sparkforge.shared.image_inputs import TargetImages
from sparkforge.shared.image_sources import ImageReader
from sparkforge.shared.images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageProblem,
    load_images,
    row_has_images,
)


class ImageChatEncoder(ChatEncoder):
    """A chat encoder for a VL target: image parts are pixels, not skips."""

    def __init__(self, tokenizer: Any, *, images: TargetImages,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 image_reader: ImageReader | None = None, **kwargs: Any) -> None:
        self.images = images
        self.max_image_pixels = max_image_pixels
        self.image_reader = image_reader or ImageReader()
        super().__init__(tokenizer, **kwargs)

    @property
    def target_images(self) -> TargetImages:
        """The target's image processing."""
        assert self.images is not None
        return self.images

    def attach_images(self, row: Mapping[str, Any], encoded: Encoded, *,
                      folder: str | None) -> Encoded | SkipReason:
        """Load the row's images, expand its image tokens; refuse a row whose image spans would
        not fit in ``max_seq_len`` (a cut inside or before an image)."""
        if not row_has_images(row):
            return encoded
        loaded = load_images(row["messages"], self.image_reader, folder=folder,
                             max_pixels=self.max_image_pixels)
        if isinstance(loaded, ImageProblem):
            return SkipReason(loaded.value)
        expanded = self.target_images.expand(encoded.input_ids, encoded.loss_mask, loaded)
        if isinstance(expanded, ImageProblem):
            return SkipReason(expanded.value)
        ends = np.flatnonzero(expanded.input_ids == self.target_images.eoi_token_id)
        if ends.size and ends[-1] >= self.max_seq_len:
            return SkipReason.TOO_MANY_IMAGES
        return Encoded(expanded.input_ids, expanded.loss_mask,
                       model_inputs=expanded.model_inputs, images_sha256=expanded.images_sha256)

    def _fit(self, encoded: Encoded) -> Encoded | SkipReason:
        fitted = super()._fit(encoded)
        if isinstance(fitted, SkipReason) or fitted.model_inputs is None:
            return fitted
        # The token types follow the (possibly cut) ids.
        return Encoded(fitted.input_ids, fitted.loss_mask, images_sha256=fitted.images_sha256,
                       model_inputs={**fitted.model_inputs,
                                     **self.target_images.token_types(fitted.input_ids)})
