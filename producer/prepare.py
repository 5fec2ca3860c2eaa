"""What a producer run derives from its config before it touches the cache or an engine: the
target, its feature layers, the row encoder and the data sources."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkforge.producer.chat import ChatEncoder
from sparkforge.producer.config import ProducerConfig
from sparkforge.producer.image_rows import ImageChatEncoder
from sparkforge.producer.inputs import InputRows, open_inputs
from sparkforge.producer.splits import load_eval_ids
from sparkforge.producer.target_files import resolve_model_dir
from sparkforge.producer.units import num_units
from sparkforge.shared.errors import ConfigError
from sparkforge.shared.image_inputs import target_images
from sparkforge.shared.image_sources import ImageReader
from sparkforge.shared.layer_ids import (
    HfIndices,
    LayerIdError,
    check_feature_ids,
    default_feature_ids,
    feature_to_hf,
    strided_feature_ids,
)
from sparkforge.shared.target_config import read_target_config


@dataclass(frozen=True)
class Prepared:
    """Everything a run derives from its config before touching the cache or an engine."""

    model_dir: Path
    target_config: dict[str, Any]
    hf_layer_ids: HfIndices
    encoder: ChatEncoder
    inputs: InputRows
    num_rows: int
    num_units: int
    eval_ids: frozenset[int] | None


def prepare(cfg: ProducerConfig) -> Prepared:
    """Resolve the target, layer ids, tokenizer/template and data sources of ``cfg``."""
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(cfg.engine)
    target_config = read_target_config(model_dir).text
    num_layers = target_config["num_hidden_layers"]
    try:
        feature_ids = (
            strided_feature_ids(num_layers, cfg.layer_stride, start=cfg.layer_start)
            if cfg.layer_stride is not None else check_feature_ids(
                cfg.layer_ids or default_feature_ids(num_layers, cfg.num_feature_layers),
                num_layers))
    except LayerIdError as exc:
        raise ConfigError(f"--layer_ids / --layer_stride / --num_feature_layers for a "
                          f"{num_layers}-layer target: {exc}") from exc
    encoder = chat_encoder(cfg, model_dir, AutoTokenizer.from_pretrained(str(model_dir)))
    inputs = open_inputs(cfg)
    return Prepared(
        model_dir=model_dir, target_config=target_config,
        hf_layer_ids=feature_to_hf(feature_ids), encoder=encoder, inputs=inputs,
        num_rows=inputs.num_rows, num_units=num_units(inputs.num_rows, cfg.rows_per_unit),
        eval_ids=load_eval_ids(cfg.eval_ids, cfg.storage_options) if cfg.eval_ids else None,
    )


def chat_encoder(cfg: ProducerConfig, model_dir: Path, tokenizer: Any) -> ChatEncoder:
    """The run's row encoder: with images for a VL target on the HF backend (whose processor
    runs here), else text only (image parts skip as ``image_content``)."""
    kwargs: dict[str, Any] = {"chat_template": cfg.chat_template, "reasoning": cfg.reasoning,
                              "max_seq_len": cfg.longest_sample, "overlong": cfg.overlong,
                              "template_row_seconds": cfg.template_row_seconds,
                              "chat_template_kwargs": cfg.chat_template_kwargs}
    images = (target_images(model_dir, read_target_config(model_dir).raw)
              if cfg.backend == "hf" else None)
    if images is None:
        return ChatEncoder(tokenizer, **kwargs)
    return ImageChatEncoder(tokenizer, images=images, max_image_pixels=cfg.max_image_pixels,
                            image_reader=image_reader(cfg), **kwargs)


def image_reader(cfg: ProducerConfig) -> ImageReader:
    """How the run reads image sources: its allow-list, storage options and limits."""
    return ImageReader.from_options(cfg.image_sources, storage_options=cfg.storage_options,
                                    max_bytes=cfg.max_image_bytes,
                                    timeout_s=cfg.image_read_timeout_s)
