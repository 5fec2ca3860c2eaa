"""Draft architectures: the only place an architecture is named.

Each architecture is a backbone, a folder here named as its ``ARCHITECTURES`` entry, holding
its layers (``model.py``), its serving formats (``export.py``; the qwen3 backbone's DFlash and
DFlash2 ones are ``qwen3/dflash_export.py`` and ``qwen3/dflash2_export.py``) and, when it has
them, its options (the config fields only it reads, held as the config's ``options``), their
checks and derivation from a target (``config.py``, entered in ``CONFIG_RULES``). Next to the
folders, what they share: the config (``config.py``), what it reads of each architecture
(``config_rules.py``: the names, and each options class with its checks and target
derivation), the options' base (``options.py``), the DSpark serving checks (``serving.py``)
and the tiny config the CPU tests start from (``tiny.py``). A draft is an (architecture, block
layout) pair: every backbone trains every layout (``sparkforge.trainer.draft.block_layout``),
and ``formats`` says which pairs an engine serves. Training, export and eval look the pair up
here. Importing this package does not import torch: ``build_draft`` imports the model it
builds.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from sparkforge.shared.errors import SparkforgeError
from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.config_rules import Architecture, rules_of
from sparkforge.trainer.architectures.deepseek_v4 import export as deepseek_v4_export
from sparkforge.trainer.architectures.deepseek_v4.tiny import draft_tiny_deepseek_v4
from sparkforge.trainer.architectures.gemma4 import export as gemma4_export
from sparkforge.trainer.architectures.gemma4.tiny import draft_tiny_gemma4
from sparkforge.trainer.architectures.kimi_k3 import export as kimi_k3_export
from sparkforge.trainer.architectures.kimi_k3.tiny import draft_tiny_kimi_k3
from sparkforge.trainer.architectures.options import ArchitectureOptions
from sparkforge.trainer.architectures.qwen3 import dflash2_export, dflash_export
from sparkforge.trainer.architectures.qwen3 import export as qwen3_export
from sparkforge.trainer.architectures.tiny import draft_tiny
from sparkforge.trainer.draft.block_layout import BLOCK_LAYOUTS, LAYOUTS, NO_HEADS, Layout

if TYPE_CHECKING:
    from sparkforge.trainer.draft.model import DraftModel

Engine = Literal["vllm", "sglang", "any"]


@dataclass(frozen=True, kw_only=True)
class ServingFormat:
    """How one (architecture, layout) pair is exported and read back."""

    served_as: tuple[str, ...]
    """``architectures`` names of the exported ``config.json`` that this format reads back
    (empty: no engine serves it, and ``serving_problems`` says why)."""
    method: str
    """vLLM's ``speculative_config.method`` for it."""
    hf_config: Callable[[DraftConfig], dict[str, Any]]
    """The exported ``config.json`` contents."""
    serving_problems: Callable[[DraftConfig, Engine], list[str]]
    """Reasons an engine could not serve this draft correctly (empty when it can)."""
    config_from_hf: Callable[[Mapping[str, Any]], DraftConfig]
    """Read an exported ``config.json`` back into a draft config."""
    serving_note: str = ""
    """What a user of this format must know to serve it (export logs it, the model card shows
    it; empty: nothing)."""


@dataclass(frozen=True, kw_only=True)
class DraftArchitecture:
    """How to configure, build, check and export drafts of one architecture (backbone)."""

    name: Architecture
    model: str
    """``module:attribute`` of the model class (or function) built as
    ``model(cfg, *, embed_weight=None, lm_head_weight=None, attn_implementation="sdpa")``; it
    runs the config's block layout."""
    expected_shapes: Callable[[DraftConfig], dict[str, tuple[int, ...]]]
    """Every required exported tensor and its shape (the config's heads included);
    ``embed_tokens``/``lm_head`` are optional unless listed here."""
    formats: Mapping[Layout, ServingFormat]
    """The serving format of each layout an export exists for; another layout trains only."""
    tiny: Callable[[], DraftConfig]
    """A small ``dspark`` config of this architecture for CPU tests (``tiny_draft`` gives it
    in every layout; the shared tests build each one)."""

    @property
    def options(self) -> type[ArchitectureOptions] | None:
        """The class of the config's ``options`` (None: it has none); its entry of
        ``CONFIG_RULES`` (``config_rules.py``) names it, with its checks and what it copies
        from a target."""
        return rules_of(self.name).options


_QWEN3_DSPARK = ServingFormat(
    served_as=("Qwen3DSparkModel",), method="dspark", hf_config=qwen3_export.hf_config,
    serving_problems=qwen3_export.serving_problems,
    config_from_hf=qwen3_export.draft_config_from_hf)
_QWEN3_DFLASH = ServingFormat(
    served_as=(dflash_export.SERVED_AS,), method="dflash", hf_config=dflash_export.hf_config,
    serving_problems=dflash_export.serving_problems,
    config_from_hf=dflash_export.draft_config_from_hf)
_QWEN3_DFLASH2 = ServingFormat(
    served_as=(dflash2_export.SERVED_AS,), method="dflash", hf_config=dflash2_export.hf_config,
    serving_problems=dflash_export.serving_problems,
    config_from_hf=dflash2_export.draft_config_from_hf, serving_note=dflash2_export.SERVING_NOTE)

ARCHITECTURES: dict[Architecture, DraftArchitecture] = {
    "qwen3": DraftArchitecture(
        name="qwen3", model="sparkforge.trainer.architectures.qwen3.model:Qwen3DraftModel",
        expected_shapes=qwen3_export.expected_shapes,
        formats={"dspark": _QWEN3_DSPARK, "dflash": _QWEN3_DFLASH, "dflash2": _QWEN3_DFLASH2},
        tiny=draft_tiny),
    "deepseek_v4": DraftArchitecture(
        name="deepseek_v4",
        model="sparkforge.trainer.architectures.deepseek_v4.model:DeepseekV4DraftModel",
        expected_shapes=deepseek_v4_export.expected_shapes,
        formats={"dspark": ServingFormat(
            served_as=(), method="dspark", hf_config=deepseek_v4_export.refuse_hf_config,
            serving_problems=deepseek_v4_export.serving_problems,
            config_from_hf=deepseek_v4_export.refuse_config_from_hf)},
        tiny=draft_tiny_deepseek_v4),
    "gemma4": DraftArchitecture(
        name="gemma4", model="sparkforge.trainer.architectures.gemma4.model:Gemma4DraftModel",
        expected_shapes=gemma4_export.expected_shapes,
        formats={"dspark": ServingFormat(
            served_as=("Gemma4DSparkModel",), method="dspark", hf_config=gemma4_export.hf_config,
            serving_problems=gemma4_export.serving_problems,
            config_from_hf=gemma4_export.draft_config_from_hf)},
        tiny=draft_tiny_gemma4),
    "kimi_k3": DraftArchitecture(
        name="kimi_k3", model="sparkforge.trainer.architectures.kimi_k3.model:KimiK3DraftModel",
        expected_shapes=kimi_k3_export.expected_shapes,
        formats={"dspark": ServingFormat(
            served_as=(kimi_k3_export.SERVED_AS,), method="dspark",
            hf_config=kimi_k3_export.hf_config, serving_problems=kimi_k3_export.serving_problems,
            config_from_hf=kimi_k3_export.draft_config_from_hf)},
        tiny=draft_tiny_kimi_k3),
}

DRAFT_PAIRS: tuple[tuple[str, str], ...] = tuple(itertools.product(ARCHITECTURES, LAYOUTS))
"""Every (architecture, layout) pair a draft trains as: each backbone runs each layout."""
SERVED_PAIRS: tuple[tuple[str, str], ...] = tuple(
    (arch.name, layout) for arch in ARCHITECTURES.values()
    for layout, fmt in arch.formats.items() if fmt.served_as)
"""The pairs an engine serves (an export exists and loads)."""


def architecture_of(cfg: DraftConfig) -> DraftArchitecture:
    """The architecture entry a draft config names."""
    return ARCHITECTURES[cfg.architecture]


def serving_format(cfg: DraftConfig) -> ServingFormat:
    """The serving format of the config's (architecture, layout) pair.

    Raises:
        SparkforgeError: no format exists for the pair, naming it and the pairs that serve.
    """
    fmt = architecture_of(cfg).formats.get(cfg.layout)
    if fmt is None:
        served = ", ".join(f"{a} + {lay}" for a, lay in SERVED_PAIRS)
        raise SparkforgeError(f"architecture={cfg.architecture!r} with layout={cfg.layout!r}: "
                              f"no engine serves this pair, so it trains but does not export "
                              f"(served: {served})")
    return fmt


def tiny_draft(architecture: str, layout: str = "dspark") -> DraftConfig:
    """The architecture's tiny CPU-test config in ``layout`` (headless when the layout is)."""
    cfg = ARCHITECTURES[architecture].tiny()  # type: ignore[index]
    heads = {} if BLOCK_LAYOUTS[layout].heads else dict(NO_HEADS)
    return dataclasses.replace(cfg, **{"layout": layout, **heads})


def draft_class(cfg: DraftConfig) -> Callable[..., DraftModel]:
    """The model class (or builder) of the config's architecture, imported now."""
    module, _, name = architecture_of(cfg).model.partition(":")
    built: Callable[..., DraftModel] = getattr(importlib.import_module(module), name)
    return built


def build_draft(cfg: DraftConfig, **kwargs: Any) -> DraftModel:
    """A freshly initialised draft of the config's architecture (see ``DraftArchitecture.model``).

    Every architecture's model is a ``DraftModel``: it takes the same batch and returns
    ``DraftOutput``.
    """
    return draft_class(cfg)(cfg, **kwargs)
