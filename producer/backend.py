"""Starting a capture backend: the vLLM engine or transformers (``--backend``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from sparkforge.producer.config import ProducerConfig
from sparkforge.producer.source import HiddenStateSource
from sparkforge.shared.target_config import read_target_config


def make_source(
    cfg: ProducerConfig, model_dir: Path, hf_layer_ids: Sequence[int], *, backend: str | None = None
) -> HiddenStateSource:
    """Start a capture backend (``cfg.backend`` unless ``backend`` is given)."""
    source: HiddenStateSource
    if (backend or cfg.backend) == "vllm":
        from sparkforge.producer.vllm_source import VllmSource

        Path(cfg.scratch_dir).mkdir(parents=True, exist_ok=True)
        source = VllmSource(dataclasses.replace(cfg.engine, model=str(model_dir)),
                            layer_ids=tuple(hf_layer_ids), topk=cfg.topk,
                            scratch_dir=cfg.scratch_dir, window=cfg.window,
                            max_retries=cfg.max_retries)
        return source
    return hf_source(cfg, model_dir, hf_layer_ids, dtype=None)


def hf_source(
    cfg: ProducerConfig, model_dir: Path, hf_layer_ids: Sequence[int], *, dtype: str | None,
    one_row: bool = False,
) -> HiddenStateSource:
    """The transformers backend on ``cfg.hf_device``, in ``dtype`` (None: the engine's dtype,
    or the target's when that is auto), one row per forward with ``one_row`` (and then whole; else a
    row longer than ``hf_batch_tokens`` goes in chunks)."""
    from sparkforge.producer.hf_source import HfSource

    device = cfg.hf_device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        config = read_target_config(model_dir).text
        auto = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
        dtype = cfg.engine.dtype if cfg.engine.dtype != "auto" else str(auto)
    # The parity reference (one_row) forwards each row whole, so it checks the chunked capture.
    source: HiddenStateSource = HfSource(str(model_dir), layer_ids=tuple(hf_layer_ids),
                                         dtype=dtype, topk=cfg.topk, device=device,
                                         max_batch_tokens=cfg.hf_batch_tokens,
                                         one_row=one_row, chunked=not one_row)
    return source
