"""The draft config of every architecture: the shared fields plus each architecture's own.

``DraftConfig`` (once ``DSparkDraftConfig``: it configures every recipe's draft) is
``SharedDraftConfig`` (``sparkforge.trainer.draft.config``, which holds the block ``layout``)
with the ``architecture`` name (the backbone) and the fields each architecture folder declares;
it runs the named architecture's checks on top of the generic ones, and refuses another
architecture's fields when they are set. Checkpoints and exports store it as one flat JSON
object. It is also where a dropped architecture name is read (``LEGACY_ARCHITECTURES``), so
YAML, checkpoints and exported configs all go through the one rewrite.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from sparkforge.shared.renamed import renamed_attribute
from sparkforge.trainer.architectures.deepseek_v4.config import DeepseekV4Fields
from sparkforge.trainer.architectures.kimi_k3.config import KimiK3Fields
from sparkforge.trainer.draft.block_layout import Layout
from sparkforge.trainer.draft.config import (
    SharedDraftConfig,
    target_fields,
    target_model_type,
    text_config,
)

Architecture = Literal["qwen3", "deepseek_v4", "gemma4", "kimi_k3"]
"""The draft architectures (backbones), each a folder of ``sparkforge.trainer.architectures``."""
DRAFT_ARCHITECTURES: tuple[str, ...] = get_args(Architecture)

LegacyArchitecture = Literal["dflash"]
"""Dropped ``architecture`` names that still read (``LEGACY_ARCHITECTURES``)."""
LEGACY_ARCHITECTURES: Mapping[LegacyArchitecture, tuple[Architecture, Layout]] = {
    "dflash": ("qwen3", "dflash")}
"""Dropped ``architecture`` names and the (architecture, layout) each one means; read, with a
warning, until sparkforge 0.3.0."""
LEGACY_DROPPED_IN = "0.3.0"


def read_legacy(architecture: str | None, layout: str | None) -> tuple[str | None, str | None]:
    """``(architecture, layout)``, a dropped architecture name rewritten as the pair it means.

    Warns once per rewrite (``FutureWarning``), naming the new spelling and the version that
    stops reading the old one.
    """
    if architecture not in get_args(LegacyArchitecture):
        return architecture, layout
    new_architecture, new_layout = LEGACY_ARCHITECTURES[cast(LegacyArchitecture, architecture)]
    warnings.warn(f"architecture: {architecture} is deprecated and is no longer read from "
                  f"sparkforge {LEGACY_DROPPED_IN}: write architecture: {new_architecture}, "
                  f"layout: {new_layout}", FutureWarning, stacklevel=2)
    return new_architecture, new_layout


@dataclass(frozen=True, kw_only=True)
class _Named:
    architecture: Architecture = "qwen3"
    """The draft's backbone (``Architecture``); with ``layout`` it picks the serving format:
    ``qwen3`` is the Qwen3-shaped draft every engine loads, for targets of any family (with
    ``layout: dflash``, the DFlash draft vLLM serves with ``method: dflash``); ``deepseek_v4``
    follows a DeepSeek-V4 target's attention (its sizes below come from that target);
    ``gemma4`` is the Gemma4 draft vLLM's ``Gemma4DSparkForCausalLM`` loads (k_eq_v attention,
    sandwich norms); ``kimi_k3`` is the MLA draft vLLM's ``K3DSparkForCausalLM`` loads (its MLA
    sizes below come from a Kimi target). The old ``dflash`` still reads, as ``qwen3`` with
    ``layout: dflash`` (``LEGACY_ARCHITECTURES``)."""


@dataclass(frozen=True, kw_only=True)
class DraftConfig(KimiK3Fields, DeepseekV4Fields, _Named, SharedDraftConfig):
    """A draft config of any architecture: the shared fields, its name and its own fields."""

    def __post_init__(self) -> None:
        architecture, layout = read_legacy(self.architecture, self.layout)
        object.__setattr__(self, "architecture", architecture)
        object.__setattr__(self, "layout", layout)
        super().__post_init__()

    def problems(self) -> list[str]:
        """The generic problems, then the named architecture's, then another one's fields set."""
        from sparkforge.trainer.architectures import ARCHITECTURES

        problems = super().problems()
        if self.architecture not in ARCHITECTURES:
            return [*problems, f"architecture={self.architecture!r} not in {DRAFT_ARCHITECTURES}"]
        arch = ARCHITECTURES[self.architecture]
        problems += arch.problems(self)
        for name in _ARCHITECTURE_FIELDS:
            if name not in arch.own_fields and getattr(self, name) != _DEFAULTS[name]:
                readers = [a.name for a in ARCHITECTURES.values() if name in a.own_fields]
                problems.append(f"{name}={getattr(self, name)!r}: only architecture="
                                f"{' or '.join(map(repr, readers))} reads it")
        return problems


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DraftConfig)}
_ARCHITECTURE_FIELDS = tuple(name for name in _DEFAULTS
                             if name not in {f.name for f in dataclasses.fields(_Named)}
                             and name not in {f.name for f in
                                              dataclasses.fields(SharedDraftConfig)})
"""The fields some architecture declares: every other architecture must leave them unset."""


def from_target_config(
    target_config: Any,
    *,
    mask_token_id: int,
    target_layer_ids: Sequence[int] | None = None,
    **overrides: Any,
) -> DraftConfig:
    """Derive a draft config from a target HF config (nested ``text_config`` handled).

    The generic sizes come from ``target_fields``; the named architecture copies its own
    fields from the target too (deepseek_v4, kimi_k3).

    Args:
        target_config: A transformers ``PretrainedConfig`` of the target (or any object whose
            attributes are its ``config.json`` fields).
        mask_token_id: Required; never defaulted to the pad id.
        target_layer_ids: Feature ids; default = DFlash rule for the draft depth.
        **overrides: Any draft config field (num_hidden_layers, block_size, markov_rank, ...).
    """
    from sparkforge.trainer.architectures import ARCHITECTURES

    base = target_fields(target_config, depth=int(overrides.get("num_hidden_layers", 5)))
    arch = ARCHITECTURES.get(overrides.get("architecture") or "qwen3")
    if arch is not None:
        base |= arch.target_fields(text_config(target_config), target_model_type(target_config))
    if target_layer_ids is not None:
        base["target_layer_ids"] = tuple(target_layer_ids)
    return DraftConfig(**{**base, **overrides}, mask_token_id=mask_token_id)


RENAMED = {"DSparkDraftConfig": "DraftConfig"}
"""Old names this module still serves, each as its new name (``renamed_attribute``)."""


def __getattr__(name: str) -> Any:
    """An old name of ``RENAMED``, with a FutureWarning naming its replacement."""
    return renamed_attribute(__name__, name, RENAMED)
