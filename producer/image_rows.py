"""Chat rows with images for a vision-language target: render, load images, expand placeholders.

:class:`ImageChatEncoder` is a :class:`ChatEncoder` whose rows may carry image parts. Text rows are
encoded as before. An image row's messages reach the template with ``{"type": "image"}`` parts
(one image token each); its images are read (data URI, local path or fsspec URI with the run's
storage options), decoded and checked against the pixel limit, then the target's own image
processing gives the pixel values and expands each image token into its span. Image spans are
never supervised (loss mask 0) but stay in the row as context. A bad image skips the row with its
own reason (``image_missing``, ``image_unreadable``, ``image_undecodable``, ``image_too_large``,
``too_many_images``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sparkforge.producer.chat import ChatEncoder, Encoded, SkipReason, row_tools, validate_messages
from sparkforge.shared.image_inputs import TargetImages
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
                 storage_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        self.images = images
        self.max_image_pixels = max_image_pixels
        self.storage_options = dict(storage_options or {})

    def encode(self, row: Mapping[str, Any]) -> Encoded | SkipReason:
        """Tokenize one row; an image row also gets its pixel values and expanded spans."""
        if not row_has_images(row):
            return super().encode(row)
        messages = validate_messages(row.get("messages"), self.reasoning, images=True)
        if isinstance(messages, SkipReason):
            return messages
        tools = row_tools(row)
        if isinstance(tools, SkipReason):
            return tools
        loaded = load_images(row["messages"], max_pixels=self.max_image_pixels,
                             storage_options=self.storage_options)
        if isinstance(loaded, ImageProblem):
            return SkipReason(loaded.value)
        encoded = self.encode_messages(messages, tools=tools)
        if isinstance(encoded, SkipReason):
            return encoded
        expanded = self.images.expand(encoded.input_ids, encoded.loss_mask, loaded)
        if isinstance(expanded, ImageProblem):
            return SkipReason(expanded.value)
        spans = np.flatnonzero(expanded.input_ids == self.images.eoi_token_id)
        if expanded.input_ids.shape[0] > self.max_seq_len and spans[-1] >= self.max_seq_len:
            return SkipReason.TOO_MANY_IMAGES  # a cut would split an image span
        fitted = self._fit(Encoded(expanded.input_ids, expanded.loss_mask))
        if isinstance(fitted, SkipReason):
            return fitted
        types = expanded.model_inputs["mm_token_type_ids"][:, : fitted.input_ids.shape[0]]
        return Encoded(fitted.input_ids, fitted.loss_mask,
                       model_inputs={**expanded.model_inputs, "mm_token_type_ids": types},
                       images_sha256=expanded.images_sha256)
