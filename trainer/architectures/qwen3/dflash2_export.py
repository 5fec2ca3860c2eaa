"""The qwen3 backbone's DFlash2 format (``layout: dflash2``): what vLLM loads with
``method: dflash``.

vLLM 0.32 resolves ``architectures: ["DFlash2DraftModel"]`` to ``DFlash2Qwen3ForCausalLM``: the
DFlash format (``dflash_export``) whose ``dflash_config`` also holds ``conv_kernel_size``,
``conv_group_size``, ``selector_rank`` and ``selector_top_k``, plus the tensors of every layer's
``attention_conv`` / ``mlp_conv`` and of the ``candidate_selector``. The convolution's block is
``1 + num_speculative_tokens`` query rows, so serve it with ``num_speculative_tokens =
block_size - 1``. Only vLLM's V2 (GPU) model runner drafts with the candidate head; its V1 runner,
the one CPU builds use, refuses the draft rather than serve it as DFlash. The engine checks are
DFlash's (``dflash_export.serving_problems``): the format adds tensors and config fields only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.qwen3 import dflash_export
from sparkforge.trainer.draft.block_layout import CONV_FIELDS, SELECTOR_FIELDS

SERVED_AS = "DFlash2DraftModel"
DRAFT_FIELDS = (*CONV_FIELDS, *SELECTOR_FIELDS)
"""The ``dflash_config`` fields DFlash2 adds to DFlash's."""
SERVING_NOTE = ("vLLM drafts with a DFlash2 candidate head only on its V2 GPU model runner; its "
                "CPU (V1) runner refuses the draft: 'Model Runner V1 does not support: DFlash "
                "candidate-head drafts'")


def hf_config(cfg: DraftConfig) -> dict[str, Any]:
    """``config.json`` contents: the DFlash config with the DFlash2 fields."""
    return dflash_export.dflash_hf_config(
        cfg, SERVED_AS, {name: getattr(cfg, name) for name in DRAFT_FIELDS})


def draft_config_from_hf(config: Mapping[str, Any]) -> DraftConfig:
    """Read a DFlash2 ``config.json`` as a qwen3 draft with ``layout: dflash2``."""
    inner = config.get("dflash_config") or {}
    fields = {name: inner[name] for name in DRAFT_FIELDS if inner.get(name) is not None}
    return dataclasses.replace(dflash_export.draft_config_from_hf(config), layout="dflash2",
                               **fields)
