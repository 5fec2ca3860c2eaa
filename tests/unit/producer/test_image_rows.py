"""Image rows of a VL target (the tiny multimodal Gemma4): encoded as its processor does,
captured as its one-row VL forward gives, and every bad image skipped with its own reason."""

from __future__ import annotations

import base64
import copy
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from sparkforge.app.tiny_minimax_vl import MINIMAX_IMAGE_TOKENS, build_tiny_minimax_vl
from sparkforge.app.tiny_target import IMAGE_TOKENS
from sparkforge.app.tiny_vl import data_uri, image_conversations, png_bytes, tiny_image
from sparkforge.producer.chat import ChatEncoder
from sparkforge.producer.chat_rows import SkipReason
from sparkforge.producer.hf_source import HfSource
from sparkforge.producer.image_rows import ImageChatEncoder
from sparkforge.producer.source import CaptureRequest
from sparkforge.shared.image_inputs import target_images
from sparkforge.shared.image_sources import ImageReader
from sparkforge.shared.records import SampleRows, SampleStart
from sparkforge.shared.target_config import read_target_config

LAYER_IDS = (1, 2, 3)


@pytest.fixture(scope="module")
def vl_target(tiny_family: Callable[[str], Path]) -> Path:
    return tiny_family("gemma4")


@pytest.fixture(scope="module")
def vl_targets(vl_target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Gemma4 and MiniMax-M3 VL top levels, both with image tokens and processors."""
    return {"gemma4": vl_target, "minimax_m3_vl": build_tiny_minimax_vl(
        tmp_path_factory.mktemp("minimax_vl"))}


def _encoder(target: Path, **kwargs: Any) -> ImageChatEncoder:
    images = target_images(target, read_target_config(target).raw)
    assert images is not None
    return ImageChatEncoder(AutoTokenizer.from_pretrained(target), images=images,
                            **{"max_seq_len": 512, **kwargs})


def _image_row(image: Any, text: str = "Describe the picture.") -> dict[str, Any]:
    return {"messages": [
        {"role": "user", "content": [{"type": "text", "text": text},
                                     {"type": "image_url", "image_url": {"url": data_uri(image)}},
                                     {"type": "text", "text": "Be short."}]},
        {"role": "assistant", "content": "A bright square on a gradient."}]}


def _reference_pixels(target: Path, images: list[Any]) -> tuple[dict[str, torch.Tensor],
                                                                list[int], tuple[str, ...]]:
    """The family's image processor outputs, tokens per image and (boi, eoi, image) tokens:
    transformers' Gemma4 PIL processor, or for MiniMax-M3 VL the torch port that
    ``test_minimax_vl_pixels.py`` proves equal to transformers' torchvision processor."""
    if read_target_config(target).model_type == "gemma4":
        from transformers.models.gemma4.image_processing_pil_gemma4 import (
            Gemma4ImageProcessorPil,
        )

        out = Gemma4ImageProcessorPil.from_pretrained(target)(images=images, return_tensors="pt")
        return ({"pixel_values": out["pixel_values"],
                 "image_position_ids": out["image_position_ids"]},
                out["num_soft_tokens_per_image"].tolist(), IMAGE_TOKENS)
    from sparkforge.shared.minimax_vl_pixels import MiniMaxM3VLPixels

    pixels = MiniMaxM3VLPixels.from_pretrained(target)
    out = pixels(images)
    counts = [int(g.prod()) // pixels.merge_size ** 2 for g in out["image_grid_thw"]]
    return out, counts, MINIMAX_IMAGE_TOKENS


def _reference_inputs(target: Path, row: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What the target's processor gives for a row, built here from its parts: the template's
    rendering with ``{"type": "image"}`` parts, each image token replaced by begin-of-image,
    one image token per image feature and end-of-image, and the image processor's pixels."""
    tok = AutoTokenizer.from_pretrained(target)
    images, messages = [], []
    for m in row["messages"]:
        if isinstance(m["content"], list):
            parts = []
            for p in m["content"]:
                if p["type"] == "text":
                    parts.append(p)
                else:
                    data = base64.b64decode(p["image_url"]["url"].split(",")[1])
                    images.append(Image.open(io.BytesIO(data)).convert("RGB"))
                    parts.append({"type": "image"})
            m = {**m, "content": parts}
        messages.append(m)
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    pixels, counts, tokens = _reference_pixels(target, images)
    boi, eoi, image_token = tok.convert_tokens_to_ids(list(tokens))
    per_image = iter(counts)
    expanded: list[int] = []
    for t in ids:
        expanded += [boi, *[image_token] * next(per_image), eoi] if t == image_token else [t]
    ids_t = torch.tensor([expanded])
    types = ({"mm_token_type_ids": (ids_t == image_token).long()}
             if tokens == IMAGE_TOKENS else {})
    return {"input_ids": ids_t, **pixels, **types}


def test_image_rows_are_encoded_as_the_processor_does(vl_target: Path) -> None:
    """Ids and pixels equal the processor's; image spans are context, never supervised (Gemma4,
    whose PIL processor transformers runs here)."""
    encoder = _encoder(vl_target)
    row = _image_row(tiny_image(1))
    got = encoder.encode(row)
    assert not isinstance(got, SkipReason)
    assert got.model_inputs is not None
    ref = _reference_inputs(vl_target, row)
    assert got.input_ids.tolist() == ref["input_ids"][0].tolist()
    for name in ("pixel_values", "image_position_ids", "mm_token_type_ids"):
        assert torch.equal(got.model_inputs[name], ref[name]), name
    boi, eoi = (int(np.flatnonzero(got.input_ids == t)[0]) for t in
                (encoder.target_images.boi_token_id, encoder.target_images.eoi_token_id))
    assert eoi - boi - 1 == int(ref["mm_token_type_ids"].sum()) > 0
    assert not got.loss_mask[boi:eoi + 1].any()
    tok = AutoTokenizer.from_pretrained(vl_target)
    assert "A bright square on a gradient." in tok.decode(got.input_ids[got.loss_mask == 1])
    text_only = encoder.encode({"messages": [row["messages"][0] | {"content": "Hi."},
                                             row["messages"][1]]})
    assert not isinstance(text_only, SkipReason)
    assert text_only.model_inputs is None


@pytest.mark.parametrize("family", ["gemma4", "minimax_m3_vl"])
def test_image_rows_equal_the_one_row_vl_forward(vl_targets: dict[str, Path], family: str,
                                                 tmp_path: Path) -> None:
    """Mixed text and image rows, batched by the HF backend, equal each row's own fp32 VL forward
    with the processor's pixel values (within 1e-5)."""
    vl_target = vl_targets[family]
    encoder = _encoder(vl_target)
    rows = image_conversations(6, tmp_path)
    encoded = [encoder.encode(r, folder=str(tmp_path)) for r in rows]
    assert all(not isinstance(e, SkipReason) for e in encoded)
    requests = [CaptureRequest(sample_id=i, input_ids=e.input_ids, model_inputs=e.model_inputs)
                for i, e in enumerate(encoded)]  # type: ignore[union-attr]
    assert sum(r.model_inputs is not None for r in requests) == 3
    source = HfSource(str(vl_target), layer_ids=LAYER_IDS, max_batch_tokens=4096)
    got = {r.sample_id: r for r in source.capture(requests)}
    model = AutoModelForImageTextToText.from_pretrained(vl_target, dtype=torch.float32).eval()
    for i, request in enumerate(requests):
        inputs = ({"input_ids": torch.from_numpy(request.input_ids.astype(np.int64))[None]}
                  if request.model_inputs is None else
                  _reference_inputs(vl_target, {"messages": [
                      {**m, "content": m["content"]} for m in _as_data_uris(rows[i])["messages"]]}))
        assert inputs["input_ids"][0].tolist() == request.input_ids.tolist()
        with torch.no_grad():
            states = model(**inputs, output_hidden_states=True).hidden_states
        aux = torch.stack([states[k][0] for k in LAYER_IDS], dim=1)
        for a, b in ((got[i].aux_hidden, aux), (got[i].final_hidden, states[-1][0])):
            assert float((a - b).abs().max() / b.abs().max()) < 1e-5, i


def _as_data_uris(row: dict[str, Any]) -> dict[str, Any]:
    """The row with every path-form image part turned into the data-URI form."""
    row = copy.deepcopy(row)
    for m in row["messages"]:
        if isinstance(m["content"], list):
            m["content"] = [
                {"type": "image_url", "image_url": {"url": data_uri(Image.open(p["path"]))}}
                if p["type"] == "image" else p for p in m["content"]]
    return row


@pytest.mark.parametrize("family", ["gemma4", "minimax_m3_vl"])
def test_the_image_reaches_the_target(vl_targets: dict[str, Path], family: str) -> None:
    """The same text with two different images: identical features before the image span,
    different ones from it on."""
    vl_target = vl_targets[family]
    encoder = _encoder(vl_target)
    a, b = (encoder.encode(_image_row(tiny_image(seed))) for seed in (1, 2))
    assert not isinstance(a, SkipReason)
    assert not isinstance(b, SkipReason)
    assert a.input_ids.tolist() == b.input_ids.tolist()
    source = HfSource(str(vl_target), layer_ids=LAYER_IDS)
    got = list(source.capture([CaptureRequest(sample_id=i, input_ids=e.input_ids,
                                              model_inputs=e.model_inputs)
                               for i, e in enumerate((a, b))]))
    boi = int(np.flatnonzero(a.input_ids == encoder.target_images.boi_token_id)[0])
    eoi = int(np.flatnonzero(a.input_ids == encoder.target_images.eoi_token_id)[0])
    before = (got[0].aux_hidden[:boi + 1] - got[1].aux_hidden[:boi + 1]).abs().max()
    assert float(before) == 0.0
    for t in (boi + 1, eoi, eoi + 1, a.input_ids.shape[0] - 1):   # image tokens and the text after
        assert float((got[0].aux_hidden[t] - got[1].aux_hidden[t]).abs().max()) > 1e-4, t


def _row_with(part: dict[str, Any]) -> dict[str, Any]:
    row = _image_row(tiny_image(0))
    row["messages"][0]["content"].append(part)
    return row


@pytest.mark.parametrize(("part", "reason"), [
    ({"type": "image", "path": "/nonexistent/a.png"}, "image_path_refused"),
    ({"type": "image", "url": "http://169.254.169.254/latest/meta-data/"}, "image_source_refused"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%"}}, "image_unreadable"),
    ({"type": "image", "image": b"GIF89a broken"}, "image_undecodable"),
    ({"type": "image", "image": png_bytes(Image.new("RGB", (300, 300)))}, "image_too_large"),
])
def test_each_bad_image_is_its_own_skip_reason(vl_target: Path, part: dict[str, Any],
                                               reason: str) -> None:
    """A row with one bad image (after a good one) is skipped with that image's reason."""
    encoder = _encoder(vl_target, max_image_pixels=256 * 256)
    assert encoder.encode(_row_with(part)) == SkipReason(reason)


def test_images_that_do_not_fit_the_context_are_too_many(vl_target: Path) -> None:
    """Image spans past max_seq_len skip the row as too_many_images, even under truncation;
    a cut after the last image span keeps the row."""
    row = _image_row(tiny_image(0))
    full = _encoder(vl_target).encode(row)
    assert not isinstance(full, SkipReason)
    eoi = int(np.flatnonzero(full.input_ids == 5)[-1])
    short = _encoder(vl_target, max_seq_len=eoi, overlong="truncate")
    assert short.encode(row) == SkipReason.TOO_MANY_IMAGES
    cut = _encoder(vl_target, max_seq_len=full.input_ids.shape[0] - 2, overlong="truncate")
    kept = cut.encode(row)
    assert not isinstance(kept, SkipReason)
    assert kept.model_inputs is not None
    assert kept.model_inputs["mm_token_type_ids"].shape[-1] == kept.input_ids.shape[0]


def test_a_template_that_drops_images_is_refused_per_row(vl_target: Path) -> None:
    """A template rendering no image token for an image part cannot place the image."""
    template = AutoTokenizer.from_pretrained(vl_target).chat_template.replace(
        "'<|image|>'", "''")
    assert _encoder(vl_target, chat_template=template).encode(
        _image_row(tiny_image(0))) == SkipReason.TOO_MANY_IMAGES


def test_a_text_only_target_still_skips_image_content(tiny_target: Path) -> None:
    """A text target (no image processing) skips image rows as image_content."""
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(tiny_target), max_seq_len=512)
    assert target_images(tiny_target, read_target_config(tiny_target).raw) is None
    assert encoder.encode(_image_row(tiny_image(0))) == SkipReason.IMAGE_CONTENT


def test_a_rerun_detects_a_changed_image_behind_an_unchanged_path(vl_target: Path,
                                                                  tmp_path: Path) -> None:
    """Each image row's source_hash covers its image bytes; a re-run over a cache whose path-form
    image changed (the dataset file did not) stops naming the sample; restored, it passes."""
    from producer_helpers import producer_config, write_jsonl

    from sparkforge.producer.engine_options import EngineOptions
    from sparkforge.producer.run import run
    from sparkforge.shared.writer import CacheMismatchError

    rows = image_conversations(8, tmp_path / "images")
    path_row = next(i for i, r in enumerate(rows) if any(
        isinstance(m["content"], list) and any("path" in p for p in m["content"])
        for m in r["messages"]))
    image_path = Path(next(p["path"] for m in rows[path_row]["messages"]
                           if isinstance(m["content"], list) for p in m["content"] if "path" in p))
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = producer_config(vl_target, data, str(tmp_path / "cache"), shard_rows=1024,
                          engine=EngineOptions(model=str(vl_target), max_model_len=512,
                                               dtype="float32"))
    assert run(cfg).accounting().written == 8
    original = image_path.read_bytes()
    image_path.write_bytes(png_bytes(tiny_image(999)))
    with pytest.raises(CacheMismatchError, match=rf"samples \[{path_row}\]"):
        run(cfg)
    image_path.write_bytes(original)
    assert run(cfg).units_todo == 0


# Sizes (width, height) around each tiny target's limits: the tiny Gemma4's vision tower places
# at most 64 patches of 4 pixels per side (its processor up to 140), MiniMax-M3 VL's processor
# refuses aspect ratios past 200.
SHAPES = [(1, 1), (28, 20), (300, 7), (7, 300), (60, 4), (4, 60), (1000, 2), (2, 1000),
          (1, 100_000)]


@pytest.fixture(scope="module")
def vl_sources(vl_targets: dict[str, Path]) -> dict[str, HfSource]:
    """One fp32 HF backend per tiny VL family."""
    return {family: HfSource(str(target), layer_ids=LAYER_IDS, dtype="float32")
            for family, target in vl_targets.items()}


def _forward_unchecked(source: HfSource, images: Any, image: Any) -> None:
    """The processor and the VL forward on one image, without the size check."""
    inputs, _ = images.pixels([image])
    ids = torch.tensor([[images.image_token_id] * 4])
    source.model(input_ids=ids, **inputs, **images.token_types(ids))


@pytest.mark.parametrize("family", ["gemma4", "minimax_m3_vl"])
def test_only_images_the_target_cannot_take_are_refused(
        vl_targets: dict[str, Path], vl_sources: dict[str, HfSource], family: str) -> None:
    """Every size the encoder admits gets the processor's token count and captures; every size it
    refuses (image_shape_unsupported, before the forward) is one on which the processor or the
    vision forward fails."""
    encoder = _encoder(vl_targets[family], max_seq_len=512)
    images = encoder.target_images
    refused = []
    for width, height in SHAPES:
        image = Image.new("RGB", (width, height), (200, 30, 90))
        got = encoder.encode(_image_row(image))
        if got == SkipReason.IMAGE_SHAPE_UNSUPPORTED:
            refused.append((width, height))
            with pytest.raises((IndexError, ValueError)):
                _forward_unchecked(vl_sources[family], images, image)
            continue
        assert not isinstance(got, SkipReason), (width, height, got)
        assert images.pixels([image])[1] == [images.num_tokens(width, height)]
        result = next(iter(vl_sources[family].capture([CaptureRequest(
            sample_id=0, input_ids=got.input_ids, model_inputs=got.model_inputs)])))
        assert result.error is None
        assert result.skipped is None
        assert result.aux_hidden is not None
    assert refused, "no size tried reaches the limits"


def test_an_image_of_exactly_max_image_pixels_is_refused_from_its_header(vl_target: Path) -> None:
    """A valid 1 x 16,777,216 PNG (exactly the default max_image_pixels), which the tiny Gemma4's
    vision tower cannot place, is skipped by its size before it is decoded."""
    data = png_bytes(Image.new("RGB", (16_777_216, 1)))
    got = _encoder(vl_target).encode(_row_with({"type": "image", "image": data}))
    assert got == SkipReason.IMAGE_SHAPE_UNSUPPORTED


class _SampleIds:
    """A sink keeping only the ids of the samples it was handed whole."""

    def __init__(self) -> None:
        self.ended: list[int] = []
        self._current: int | None = None

    def begin(self, start: SampleStart) -> None:
        self._current = start.sample_id

    def add(self, rows: SampleRows) -> None:
        assert self._current is not None

    def end(self) -> None:
        assert self._current is not None
        self.ended.append(self._current)

    def abandon(self) -> None:
        self._current = None


def test_a_vision_forward_that_raises_skips_its_row_only(
        vl_targets: dict[str, Path], vl_sources: dict[str, HfSource]) -> None:
    """An image row whose forward raises is counted as image_processing_failed, not as a failed
    request, and the unit's other rows are captured."""
    from sparkforge.producer.capture import FailureRun, UnitCapturer
    from sparkforge.producer.splits import SplitRule
    from sparkforge.shared.dataset import RawRow

    encoder = _encoder(vl_targets["gemma4"])
    good = _image_row(tiny_image(0))
    broken = encoder.encode(good)
    assert not isinstance(broken, SkipReason)
    assert broken.model_inputs is not None
    positions = broken.model_inputs["image_position_ids"]
    poisoned = {**broken.model_inputs, "image_position_ids": positions.clamp(min=0) + 10_000}

    class Poisoning(ImageChatEncoder):
        """Hands the backend out-of-range patch positions for the row marked ``poison``."""

        def encode(self, row: Any, *, folder: str | None = None) -> Any:
            got = super().encode({k: v for k, v in row.items() if k != "poison"}, folder=folder)
            return (type(got)(got.input_ids, got.loss_mask, model_inputs=poisoned,
                              images_sha256=got.images_sha256) if "poison" in row else got)

    poisoning = Poisoning(encoder.tokenizer, images=encoder.target_images, max_seq_len=512)
    capturer = UnitCapturer(poisoning, SplitRule(0.0, None, 0), len(LAYER_IDS), "float32", 0,
                            FailureRun(1))
    rows = [RawRow(index=i, row=row, content_hash=str(i))
            for i, row in enumerate([good, {**good, "poison": True}, good])]
    written = _SampleIds()
    accounting = capturer.stream(vl_sources["gemma4"], rows, written)
    assert written.ended == [0, 2]
    assert accounting.skipped == {"image_processing_failed": 1}
    assert accounting.failed == 0


class _CountingReader(ImageReader):
    """The real reader, counting the images it is asked to read."""

    def read(self, source: str | bytes, *, folder: str | None) -> bytes | Any:
        object.__setattr__(self, "reads", getattr(self, "reads", 0) + 1)
        return super().read(source, folder=folder)


@pytest.mark.parametrize(("num_images", "fitting", "reads"), [
    (200, None, 0),  # 200 one-token spans cannot fit in 512: refused before any read
    (3, 1, 2),       # the first image's span fits, the second's does not: the third is unread
])
def test_images_past_max_seq_len_are_refused_before_they_are_read(
        vl_target: Path, tmp_path: Path, num_images: int, fitting: int | None,
        reads: int) -> None:
    """A row's image count and each image's span are checked before the next image is read, so a
    row of many slow images costs no reads past the one that does not fit."""
    path = tmp_path / "a.png"
    path.write_bytes(png_bytes(tiny_image(3, size=(64, 64))))
    row = {"messages": [
        {"role": "user", "content": [*[{"type": "image", "path": "a.png"}] * num_images,
                                     {"type": "text", "text": "Which is which?"}]},
        {"role": "assistant", "content": "The same one."}]}
    max_seq_len = 512
    if fitting is not None:  # just past the end of the first `fitting` spans
        full = _encoder(vl_target, max_seq_len=4096).encode(row, folder=str(tmp_path))
        assert not isinstance(full, SkipReason)
        max_seq_len = int(np.flatnonzero(full.input_ids == 5)[fitting - 1]) + 2
    reader = _CountingReader()
    encoder = _encoder(vl_target, max_seq_len=max_seq_len, image_reader=reader)
    assert encoder.encode(row, folder=str(tmp_path)) == SkipReason.TOO_MANY_IMAGES
    assert getattr(reader, "reads", 0) == reads
