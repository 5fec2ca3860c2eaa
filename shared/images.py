"""Image parts of chat rows: find them, read their bytes, decode them, hash them.

A message's ``content`` may be a list of parts. Image parts come in the OpenAI form
``{"type": "image_url", "image_url": {"url": ...}}`` (``input_image`` with ``image_url`` too) and
the Hugging Face form ``{"type": "image", "url" | "path" | "image": ...}``. The source is a data
URI (``data:image/png;base64,...``), a local path or a remote URI (``s3://...``, ``https://...``),
read by an :class:`~sparkforge.shared.image_sources.ImageReader` under the operator's allow-list.
Every failure is a typed reason, so a run counts bad images and carries on.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparkforge.shared.image_sources import ImageReader

IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
"""Largest ``width * height`` decoded by default: larger images are skipped (a decompression
bomb guard; PIL's own guard warns only above 89 M pixels)."""


class ImageProblem(StrEnum):
    """Why a row's images cannot be used; the values are skip reasons in the accounting."""

    MISSING = "image_missing"
    """An image part without a source, or a path/object that does not exist."""
    UNREADABLE = "image_unreadable"
    """The source exists but its bytes cannot be read (a malformed data URI, an I/O error, a
    store client's failure, an HTTP answer other than 200)."""
    NOT_A_FILE = "image_not_a_file"
    """A local path that is a folder, a FIFO or a device (never opened for reading)."""
    TOO_MANY_BYTES = "image_too_many_bytes"
    """More encoded bytes than ``max_image_bytes`` (the read stops there)."""
    READ_TIMEOUT = "image_read_timeout"
    """Not read within ``image_read_timeout_s``."""
    PROTOCOL_REFUSED = "image_protocol_refused"
    """A protocol no operator may allow (ftp, hf, ...) or a chained one (``simplecache::``)."""
    SOURCE_REFUSED = "image_source_refused"
    """A remote URI under no ``--image_sources`` prefix (nor the data file's remote folder)."""
    PATH_REFUSED = "image_path_refused"
    """A local path outside the data file's folder and every ``--image_sources`` folder."""
    ADDRESS_REFUSED = "image_address_refused"
    """An allowed host that resolves to a link-local or cloud metadata address (never
    contacted), or does not resolve."""
    UNDECODABLE = "image_undecodable"
    """The bytes are no image PIL can decode."""
    TOO_LARGE = "image_too_large"
    """More pixels than ``max_image_pixels``."""
    SHAPE_UNSUPPORTED = "image_shape_unsupported"
    """A size the target's image processing cannot take (an aspect ratio past its limit, a patch
    grid past its vision tower's position table), refused before the forward."""
    PROCESSING_FAILED = "image_processing_failed"
    """The target's image processor or its vision forward raised on the row's images."""
    TOO_MANY = "too_many_images"
    """The image placeholders do not fit in ``max_seq_len`` (or the template dropped some)."""


@dataclass(frozen=True, kw_only=True)
class LoadedImages:
    """A row's decoded images, in the order their parts appear, and their identity."""

    images: tuple[Any, ...]
    """RGB ``PIL.Image.Image`` objects."""
    sha256: str
    """sha256 over every image's bytes (each prefixed by its length), in order."""


def is_image_part(part: object) -> bool:
    """A content part holding an image (``image_url``, ``input_image`` or ``image``)."""
    return isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES


def row_has_images(row: Mapping[str, Any] | None) -> bool:
    """Whether any message of a chat row carries an image part."""
    messages = None if row is None else row.get("messages")
    if not isinstance(messages, list):
        return False
    return any(isinstance(m, Mapping) and isinstance(m.get("content"), list)
               and any(is_image_part(p) for p in m["content"]) for m in messages)


def image_sources(messages: Sequence[Mapping[str, Any]]) -> list[str | bytes] | ImageProblem:
    """The source of each image part (a URI/path string or raw bytes), in message order."""
    sources: list[str | bytes] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not is_image_part(part):
                continue
            source = _part_source(part)
            if source is None:
                return ImageProblem.MISSING
            sources.append(source)
    return sources


def _part_source(part: Mapping[str, Any]) -> str | bytes | None:
    if part.get("type") in ("image_url", "input_image"):
        inner = part.get("image_url")
        url = inner.get("url") if isinstance(inner, Mapping) else inner
        return url if isinstance(url, str) and url else None
    for key in ("url", "path", "image"):
        value = part.get(key)
        if isinstance(value, str) and value or isinstance(value, bytes) and value:
            return value
    return None


Admit = Callable[[int, int], "ImageProblem | None"]
"""``(width, height) -> problem or None``: a caller's check of an image's size, before it is
decoded (and before the row's next image is read)."""


def decode_image(data: bytes, max_pixels: int, admit: Admit | None = None) -> Any:
    """An RGB PIL image of ``data``, or the problem (the pixel limit and ``admit`` checked on
    the header, before decoding)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > max_pixels:
            return ImageProblem.TOO_LARGE
        problem = None if admit is None else admit(image.width, image.height)
        if problem is not None:
            return problem
        image.load()
        return image.convert("RGB")
    except Image.DecompressionBombError:
        return ImageProblem.TOO_LARGE
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return ImageProblem.UNDECODABLE


def read_images(
    messages: Sequence[Mapping[str, Any]], reader: ImageReader, *, folder: str | None
) -> list[bytes] | ImageProblem:
    """The encoded bytes of every image of ``messages`` (a row of the data file in ``folder``),
    in order; the first problem wins."""
    sources = image_sources(messages)
    if isinstance(sources, ImageProblem):
        return sources
    return _each(sources, lambda source: reader.read(source, folder=folder))


def _each(items: Sequence[Any], step: Any) -> list[Any] | ImageProblem:
    """``step`` of every item, or the first problem it returns."""
    out = []
    for item in items:
        got = step(item)
        if isinstance(got, ImageProblem):
            return got
        out.append(got)
    return out


def images_sha256(encoded: Sequence[bytes]) -> str:
    """sha256 over the images' bytes, each prefixed by its length, in order."""
    digest = hashlib.sha256()
    for data in encoded:
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def load_images(
    messages: Sequence[Mapping[str, Any]], reader: ImageReader, *, folder: str | None,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, admit: Admit | None = None,
) -> LoadedImages | ImageProblem:
    """Read, check and decode every image of ``messages`` (a row of the data file in
    ``folder``), one image after the other; the first problem wins, and no image after it is
    read. ``admit`` sees each image's size before it is decoded."""
    sources = image_sources(messages)
    if isinstance(sources, ImageProblem):
        return sources
    encoded, images = [], []
    for source in sources:
        data = reader.read(source, folder=folder)
        if isinstance(data, ImageProblem):
            return data
        image = decode_image(data, max_pixels, admit)
        if isinstance(image, ImageProblem):
            return image
        encoded.append(data)
        images.append(image)
    return LoadedImages(images=tuple(images), sha256=images_sha256(encoded))


def template_parts(content: Sequence[Any]) -> list[dict[str, Any]] | None:
    """A content list as chat templates read it: ``{"type": "text", "text": ...}`` and
    ``{"type": "image"}`` parts (sources left out); None if a part is neither."""
    parts: list[dict[str, Any]] = []
    for part in content:
        if is_image_part(part):
            parts.append({"type": "image"})
        elif (isinstance(part, Mapping) and part.get("type") == "text"
              and isinstance(part.get("text"), str)):
            parts.append({"type": "text", "text": part["text"]})
        else:
            return None
    return parts
