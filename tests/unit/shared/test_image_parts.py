"""Image parts of chat rows: every source form is read, every bad image is its own reason."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from sparkforge.app.tiny_vl import data_uri, png_bytes, tiny_image
from sparkforge.shared.image_sources import ImageReader
from sparkforge.shared.images import (
    ImageProblem,
    image_sources,
    load_images,
    row_has_images,
    template_parts,
)


def _user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


def test_every_part_form_gives_its_source_in_order(tmp_path: Path) -> None:
    """OpenAI image_url / input_image and HF url / path / image parts, in message order."""
    messages = [*_user({"type": "image_url", "image_url": {"url": "data:a"}},
                       {"type": "image", "path": "/x.png"}),
                {"role": "assistant", "content": "A square."},
                *_user({"type": "input_image", "image_url": "s3://b/c.png"},
                       {"type": "image", "url": "https://h/i.png"},
                       {"type": "image", "image": b"raw"})]
    assert image_sources(messages) == ["data:a", "/x.png", "s3://b/c.png", "https://h/i.png",
                                       b"raw"]
    assert row_has_images({"messages": messages})
    assert not row_has_images({"messages": [{"role": "user", "content": "no image"}]})
    assert template_parts(messages[0]["content"]) == [
        {"type": "image"}, {"type": "image"}, {"type": "text", "text": "What is it?"}]
    assert template_parts([{"type": "audio"}]) is None


def test_data_uri_path_and_bytes_decode_to_the_same_pixels(tmp_path: Path) -> None:
    """The three local forms of one PNG give identical RGB pixels and the same hash."""
    image = tiny_image(3)
    path = tmp_path / "a.png"
    path.write_bytes(png_bytes(image))
    loaded = [load_images(_user(part), ImageReader(), folder=str(tmp_path)) for part in (
        {"type": "image_url", "image_url": {"url": data_uri(image)}},
        {"type": "image", "path": str(path)},
        {"type": "image", "image": png_bytes(image)})]
    for got in loaded:
        assert not isinstance(got, ImageProblem)
        assert np.array_equal(np.asarray(got.images[0]), np.asarray(image))
    assert len({got.sha256 for got in loaded}) == 1  # type: ignore[union-attr]


def test_the_hash_follows_the_image_bytes_and_their_order(tmp_path: Path) -> None:
    """Another image, or the same two in the other order, is another hash."""
    a, b = ({"type": "image_url", "image_url": {"url": data_uri(tiny_image(s))}} for s in (1, 2))
    hashes = [load_images(_user(*parts), ImageReader(),  # type: ignore[union-attr]
                          folder=None).sha256 for parts in
              ((a,), (b,), (a, b), (b, a))]
    assert len(set(hashes)) == 4


def test_an_fsspec_uri_is_read_with_the_storage_options(moto_server: dict[str, Any]) -> None:
    """An s3:// image under an allowed prefix is read with the run's storage options (a real S3
    emulator)."""
    import fsspec

    image = tiny_image(5)
    uri = f"s3://{moto_server['bucket']}/images/a.png"
    with fsspec.open(uri, "wb", **moto_server["storage_options"]) as f:
        f.write(png_bytes(image))
    reader = ImageReader.from_options([f"s3://{moto_server['bucket']}/images"],
                                      storage_options=moto_server["storage_options"])
    got = load_images(_user({"type": "image", "url": uri}), reader, folder=None)
    assert not isinstance(got, ImageProblem)
    assert np.array_equal(np.asarray(got.images[0]), np.asarray(image))
    missing = load_images(_user({"type": "image", "url": uri + ".gone"}), reader, folder=None)
    assert missing is ImageProblem.MISSING


@pytest.mark.parametrize(("part", "problem"), [
    ({"type": "image_url", "image_url": {}}, ImageProblem.MISSING),
    ({"type": "image"}, ImageProblem.MISSING),
    ({"type": "image", "path": "{tmp}/nowhere.png"}, ImageProblem.MISSING),
    ({"type": "image", "path": "{tmp}"}, ImageProblem.NOT_A_FILE),
    ({"type": "image", "path": "/etc/hostname"}, ImageProblem.PATH_REFUSED),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@notbase64@@"}},
     ImageProblem.UNREADABLE),
    ({"type": "image_url", "image_url": {"url": "data:image/png,plain"}}, ImageProblem.UNREADABLE),
    ({"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(b"not an image").decode()}},
     ImageProblem.UNDECODABLE),
    ({"type": "image", "image": png_bytes(Image.new("RGB", (64, 65)))}, ImageProblem.TOO_LARGE),
])
def test_each_bad_image_has_its_own_problem(part: dict[str, Any], problem: ImageProblem,
                                            tmp_path: Path) -> None:
    """Missing, unreadable, undecodable and over-the-pixel-limit images are told apart."""
    fixed = {k: (v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v)
             for k, v in part.items()}
    good = {"type": "image_url", "image_url": {"url": data_uri(tiny_image(0))}}
    reader, folder = ImageReader(), str(tmp_path)
    assert load_images(_user(good, fixed), reader, folder=folder, max_pixels=64 * 64) is problem
    assert not isinstance(load_images(_user(good), reader, folder=folder, max_pixels=64 * 64),
                          ImageProblem)
