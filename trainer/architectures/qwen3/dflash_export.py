"""The qwen3 backbone's DFlash format (``layout: dflash``): what vLLM loads with ``method: dflash``.

vLLM 0.32 resolves ``architectures: ["DFlashDraftModel"]`` to ``DFlashQwen3ForCausalLM``: a
Qwen3 backbone (``model_type: qwen3``) whose ``dflash_config`` holds ``mask_token_id`` and the
0-based ``target_layer_ids`` (it adds 1 to them itself), with bare tensor keys: ``fc``,
``hidden_norm``, ``layers.{i}.*``, ``norm`` and optionally the frozen ``embed_tokens`` /
``lm_head``, i.e. the DSpark key set without ``markov_head`` and ``confidence_head``. vLLM takes
``num_speculative_tokens`` (= ``block_size - 1``) from the serving command, not from the config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.qwen3 import export as export_qwen3
from sparkforge.trainer.architectures.qwen3.export import backbone_config
from sparkforge.trainer.draft.block_layout import NO_HEADS

if TYPE_CHECKING:
    from sparkforge.trainer.architectures import Engine

SERVED_AS = "DFlashDraftModel"


def serving_problems(cfg: DraftConfig, engine: Engine) -> list[str]:
    """Reasons ``engine`` could not serve this draft correctly (empty when it can).

    The config itself already refuses heads on a ``dflash`` layout; what is left is what no
    Qwen3-shaped format can express.
    """
    return export_qwen3.backbone_problems(cfg, engine)


def hf_config(cfg: DraftConfig) -> dict[str, Any]:
    """``config.json`` contents: a Qwen3Config with the DFlash fields."""
    return dflash_hf_config(cfg, SERVED_AS)


def dflash_hf_config(cfg: DraftConfig, served_as: str,
                     draft_fields: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A Qwen3Config served as ``served_as`` whose ``dflash_config`` holds the mask id, the
    feature ids and ``draft_fields`` (DFlash and its successors)."""
    from transformers import Qwen3Config

    fields = {
        **backbone_config(cfg), "architectures": [served_as],
        "dflash_config": {"mask_token_id": cfg.mask_token_id,
                          "target_layer_ids": list(cfg.target_layer_ids),
                          **dict(draft_fields or {})},
        "num_anchors": cfg.num_anchors, "max_window_layers": cfg.num_hidden_layers,
    }
    out: dict[str, Any] = Qwen3Config(**fields, dtype="bfloat16").to_dict()
    assert out["model_type"] == "qwen3", out["model_type"]
    assert out["architectures"] == [served_as], out["architectures"]
    return out


def draft_config_from_hf(config: Mapping[str, Any]) -> DraftConfig:
    """Read a DFlash ``config.json`` as a qwen3 draft with ``layout: dflash`` (``dflash_config``
    values win over top-level ones)."""
    flat = {**config, **(config.get("dflash_config") or {}), **NO_HEADS}
    return dataclasses.replace(export_qwen3.draft_config_from_hf(flat), layout="dflash")
