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

from sparkforge.producer.chat import ChatEncoder, Encoded
from sparkforge.producer.chat_rows import SkipReason
from sparkforge.shared.image_inputs import TargetImages
from sparkforge.shared.image_sources import ImageReader
from sparkforge.shared.images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageProblem,
    image_sources,
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
        not fit in ``max_seq_len`` (a cut inside or before an image) as soon as that is known:
        before any read when even one-token spans would not fit, else at the first image whose
        size (read from its header) ends its span too late, before the next image is read."""
        if not row_has_images(row):
            return encoded
        sources = image_sources(row["messages"])
        if isinstance(sources, ImageProblem):
            return SkipReason(sources.value)
        slots = np.flatnonzero(encoded.input_ids == self.target_images.image_token_id)
        # The k-th span ends at slot_k + 2 (k + 1) at the earliest (one image token each).
        if slots.size != len(sources) or (
                slots.size and slots[-1] + 2 * slots.size >= self.max_seq_len):
            return SkipReason.TOO_MANY_IMAGES
        loaded = load_images(row["messages"], self.image_reader, folder=folder,
                             max_pixels=self.max_image_pixels,
                             admit=_SpanFit(self.target_images, slots, self.max_seq_len))
        if isinstance(loaded, ImageProblem):
            return SkipReason(loaded.value)
        expanded = self.target_images.expand(encoded.input_ids, encoded.loss_mask, loaded)
        if isinstance(expanded, ImageProblem):
            return SkipReason(expanded.value)
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


class _SpanFit:
    """Places a row's image spans one image at a time, from each image's size: refuses an image
    the processing cannot take, or whose span ends past ``max_seq_len``."""

    def __init__(self, images: TargetImages, slots: np.ndarray, max_seq_len: int) -> None:
        self.images, self.slots, self.max_seq_len = images, slots.tolist(), max_seq_len
        self.shift = 0
        """Tokens the spans placed so far add before the next slot."""
        self.placed = 0

    def __call__(self, width: int, height: int) -> ImageProblem | None:
        n = self.images.num_tokens(width, height)
        if isinstance(n, ImageProblem):
            return n
        end = self.slots[self.placed] + self.shift + n + 1  # boi, n image tokens, eoi
        if end >= self.max_seq_len:
            return ImageProblem.TOO_MANY
        self.shift += n + 1
        self.placed += 1
        return None
