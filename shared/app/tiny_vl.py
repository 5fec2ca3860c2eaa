"""Chat rows with small generated images, for the tiny multimodal targets (demos and tests).

Every other row carries one image (a few carry two) in the user turn: an OpenAI ``image_url`` part
with a PNG data URI, or a Hugging Face ``image`` part with the path of a PNG written next to the
rows. The images are seeded colour gradients with a square, so two rows differ in their pixels.
"""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path
from typing import Any

from sparkforge.app.tiny_text import demo_conversations


def tiny_image(seed: int, *, size: tuple[int, int] = (28, 20)) -> Any:
    """A small RGB PIL image: a seeded gradient with a bright square."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    width, height = size
    x = np.linspace(0.0, 1.0, width)[None, :, None]
    y = np.linspace(0.0, 1.0, height)[:, None, None]
    base = rng.uniform(0.2, 1.0, size=3)
    pixels = (255 * (x * base + y * (1 - base))).astype(np.uint8)
    top, left = int(rng.integers(0, height - 6)), int(rng.integers(0, width - 6))
    pixels[top:top + 6, left:left + 6] = 255
    return Image.fromarray(pixels, "RGB")


def png_bytes(image: Any) -> bytes:
    """``image`` encoded as PNG."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_uri(image: Any) -> str:
    """``image`` as a PNG data URI."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def image_conversations(num_rows: int, image_dir: Path, *, seed: int = 0) -> list[dict[str, Any]]:
    """``demo_conversations`` where every other row's first user turn shows one or two images.

    Path-form images are written to ``image_dir`` as ``image-<row>-<k>.png``.
    """
    rng = random.Random(seed)
    rows = demo_conversations(num_rows, seed=seed)
    image_dir.mkdir(parents=True, exist_ok=True)
    for i, row in enumerate(rows):
        if i % 2:
            continue
        parts: list[dict[str, Any]] = []
        for k in range(2 if rng.random() < 0.2 else 1):
            image = tiny_image(seed * 100_003 + 10 * i + k)
            if (i // 2) % 2:
                path = image_dir / f"image-{i}-{k}.png"
                path.write_bytes(png_bytes(image))
                parts.append({"type": "image", "path": str(path)})
            else:
                parts.append({"type": "image_url", "image_url": {"url": data_uri(image)}})
        messages: list[dict[str, Any]] = row["messages"]  # type: ignore[assignment]
        user = next(m for m in messages if m["role"] == "user")
        user["content"] = [*parts, {"type": "text", "text": user["content"]}]
    return rows
