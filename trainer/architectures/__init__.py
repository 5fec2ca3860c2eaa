"""Draft architectures: the layer stack a draft is built with and the serving format it exports to.

``DSparkDraftConfig.architecture`` names one entry of ``ARCHITECTURES``. Training, export and eval
look the architecture up here, so a new draft architecture is one module with its model and
format plus one entry in this table, not branches spread over the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from sparkforge.trainer.architectures.deepseek_v4 import export as export_deepseek_v4
from sparkforge.trainer.architectures.deepseek_v4.model import DeepseekV4DSparkModel
from sparkforge.trainer.architectures.dflash import export as export_dflash
from sparkforge.trainer.architectures.dflash.model import dflash_draft
from sparkforge.trainer.architectures.gemma4 import export as export_gemma4
from sparkforge.trainer.architectures.gemma4.model import Gemma4DSparkModel
from sparkforge.trainer.architectures.kimi_k3 import export as export_kimi_k3
from sparkforge.trainer.architectures.kimi_k3.model import K3DSparkModel
from sparkforge.trainer.architectures.qwen3 import export as export_qwen3
from sparkforge.trainer.draft.config import DSparkDraftConfig
from sparkforge.trainer.draft.model import DSparkDraftModel

Engine = Literal["vllm", "sglang", "any"]


@dataclass(frozen=True, kw_only=True)
class DraftArchitecture:
    """How to build, check and export drafts of one architecture."""

    name: str
    served_as: tuple[str, ...]
    """``architectures`` names of the exported ``config.json`` that this architecture reads back."""
    model: Callable[..., nn.Module]
    """``model(cfg, *, embed_weight=None, lm_head_weight=None, attn_implementation="sdpa")``."""
    expected_shapes: Callable[[DSparkDraftConfig], dict[str, tuple[int, ...]]]
    """Every required exported tensor and its shape; ``embed_tokens``/``lm_head`` are optional
    unless listed here."""
    hf_config: Callable[[DSparkDraftConfig], dict[str, Any]]
    """The exported ``config.json`` contents."""
    serving_problems: Callable[[DSparkDraftConfig, Engine], list[str]]
    """Reasons an engine could not serve this draft correctly (empty when it can)."""
    config_from_hf: Callable[[Mapping[str, Any]], DSparkDraftConfig]
    """Read an exported ``config.json`` back into a draft config."""


ARCHITECTURES: dict[str, DraftArchitecture] = {
    "qwen3": DraftArchitecture(
        name="qwen3", served_as=("Qwen3DSparkModel",), model=DSparkDraftModel,
        expected_shapes=export_qwen3.expected_shapes, hf_config=export_qwen3.hf_config,
        serving_problems=export_qwen3.serving_problems,
        config_from_hf=export_qwen3.draft_config_from_hf),
    "dflash": DraftArchitecture(
        name="dflash", served_as=(export_dflash.SERVED_AS,), model=dflash_draft,
        expected_shapes=export_dflash.expected_shapes, hf_config=export_dflash.hf_config,
        serving_problems=export_dflash.serving_problems,
        config_from_hf=export_dflash.draft_config_from_hf),
    "deepseek_v4": DraftArchitecture(
        name="deepseek_v4", served_as=(), model=DeepseekV4DSparkModel,
        expected_shapes=export_deepseek_v4.expected_shapes,
        hf_config=export_deepseek_v4.refuse_hf_config,
        serving_problems=export_deepseek_v4.serving_problems,
        config_from_hf=export_deepseek_v4.refuse_config_from_hf),
    "gemma4": DraftArchitecture(
        name="gemma4", served_as=("Gemma4DSparkModel",), model=Gemma4DSparkModel,
        expected_shapes=export_gemma4.expected_shapes, hf_config=export_gemma4.hf_config,
        serving_problems=export_gemma4.serving_problems,
        config_from_hf=export_gemma4.draft_config_from_hf),
    "kimi_k3": DraftArchitecture(
        name="kimi_k3", served_as=(export_kimi_k3.SERVED_AS,), model=K3DSparkModel,
        expected_shapes=export_kimi_k3.expected_shapes, hf_config=export_kimi_k3.hf_config,
        serving_problems=export_kimi_k3.serving_problems,
        config_from_hf=export_kimi_k3.draft_config_from_hf),
}


def architecture_of(cfg: DSparkDraftConfig) -> DraftArchitecture:
    """The architecture entry a draft config names."""
    return ARCHITECTURES[cfg.architecture]


def build_draft(cfg: DSparkDraftConfig, **kwargs: Any) -> Any:
    """A freshly initialised draft of the config's architecture (see ``DraftArchitecture.model``).

    Every architecture's model takes the same batch and returns ``DSparkOutput``, like
    ``DSparkDraftModel``.
    """
    return architecture_of(cfg).model(cfg, **kwargs)
