"""The draft config of every architecture: the shared fields plus each architecture's own.

``DraftConfig`` (once ``DSparkDraftConfig``: it configures every recipe's draft) is
``SharedDraftConfig`` (``sparkforge.trainer.draft.config``, which holds the block ``layout``)
with the ``architecture`` name (the backbone) and the fields only it reads (``options``, of
the class its ``CONFIG_RULES`` entry names); it runs the named architecture's checks on top of
the generic ones, and refuses another architecture's options when they are set. It reads
``config_rules.py``, never the table (``ARCHITECTURES``), which imports this module.
Checkpoints and exports store it as one JSON object, ``options`` nested in it. It is also
where a dropped architecture name is read (``LEGACY_ARCHITECTURES``), so YAML, checkpoints and
exported configs all go through the one rewrite.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self, cast, get_args

from sparkforge.shared.errors import ConfigError
from sparkforge.shared.renamed import renamed_attribute
from sparkforge.trainer.architectures.config_rules import CONFIG_RULES, Architecture, rules_of
from sparkforge.trainer.architectures.options import ArchitectureOptions, options_dict
from sparkforge.trainer.draft.block_layout import Layout
from sparkforge.trainer.draft.config import (
    SharedDraftConfig,
    target_fields,
    target_model_type,
    text_config,
)

DRAFT_ARCHITECTURES: tuple[str, ...] = get_args(Architecture)
"""The draft architectures (``Architecture``, in ``config_rules.py``)."""

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
class DraftConfig(SharedDraftConfig):
    """A draft config of any architecture: the shared fields, its name and its options."""

    architecture: Architecture = "qwen3"
    """The draft's backbone (``Architecture``); with ``layout`` it picks the serving format:
    ``qwen3`` is the Qwen3-shaped draft every engine loads, for targets of any family (with
    ``layout: dflash``, the DFlash draft vLLM serves with ``method: dflash``); ``deepseek_v4``
    follows a DeepSeek-V4 target's attention (its sizes, in ``options``, come from that
    target); ``gemma4`` is the Gemma4 draft vLLM's ``Gemma4DSparkForCausalLM`` loads (k_eq_v
    attention, sandwich norms); ``kimi_k3`` is the MLA draft vLLM's ``K3DSparkForCausalLM``
    loads (its MLA sizes, in ``options``, come from a Kimi target). The old ``dflash`` still
    reads, as ``qwen3`` with ``layout: dflash`` (``LEGACY_ARCHITECTURES``)."""
    options: ArchitectureOptions | Mapping[str, Any] | None = None
    """The fields only this architecture reads, as the options class its entry names
    (``DraftArchitecture.options``: deepseek_v4's and kimi_k3's attention sizes); None for an
    architecture without any (qwen3, gemma4). A mapping is read as that class, an option left
    out taking its default."""

    def __post_init__(self) -> None:
        architecture, layout = read_legacy(self.architecture, self.layout)
        object.__setattr__(self, "architecture", architecture)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "options", _read_options(architecture, self.options))
        super().__post_init__()

    def problems(self) -> list[str]:
        """The generic problems, then another architecture's options set, then the named
        architecture's own checks."""
        problems = super().problems()
        if self.architecture not in DRAFT_ARCHITECTURES:
            return [*problems, f"architecture={self.architecture!r} not in {DRAFT_ARCHITECTURES}"]
        foreign = _foreign_options(self.architecture, self.options)
        if foreign:
            return problems + foreign
        return problems + rules_of(self.architecture).problems(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Inverse of to_dict; unknown keys are an error naming them. A config saved before
        ``options`` existed (its options as top-level keys) reads the same."""
        return super().from_dict(fold_flat_options(data))


def _option_defaults() -> dict[str, Any]:
    """Every architecture's option names and their defaults (an option two architectures
    share has one default)."""
    return {f.name: f.default for rules in CONFIG_RULES.values() if rules.options is not None
            for f in dataclasses.fields(rules.options)}


def _names(kind: type[ArchitectureOptions] | None) -> set[str]:
    return {f.name for f in dataclasses.fields(kind)} if kind is not None else set()


def _read_options(architecture: str | None, given: Any) -> Any:
    """``given`` as the architecture's options object (None: its defaults, or None when it has
    none), an option of another architecture at its default dropped (a config saved flat held
    every architecture's); what does not read stays as given, for ``problems`` to name."""
    kind = rules_of(architecture).options
    if kind is not None and isinstance(given, kind):
        return given
    try:
        values = options_dict(given)
    except ConfigError:
        return given
    own = _names(kind)
    defaults = _option_defaults()
    values = {k: v for k, v in values.items()
              if k in own or k not in defaults or v != defaults[k]}
    if set(values) - own:
        return values
    return kind(**values) if kind is not None else None


def _foreign_options(architecture: str, options: Any) -> list[str]:
    """Why ``options`` are not the architecture's: each option only another one reads."""
    kind = rules_of(architecture).options
    if options is None or (kind is not None and isinstance(options, kind)):
        return []
    if not isinstance(options, Mapping):
        return [f"options={options!r} must be a mapping of option names to values"]
    own = _names(kind)
    out = []
    for name in sorted(set(options) - own):
        readers = [a for a, rules in CONFIG_RULES.items() if name in _names(rules.options)]
        out.append(f"options.{name}={options[name]!r}: only architecture="
                   f"{' or '.join(map(repr, readers))} reads it" if readers else
                   f"options.{name}: no architecture has this option (architecture="
                   f"{architecture!r} reads {sorted(own) or 'none'})")
    return out


def fold_flat_options(data: Mapping[str, Any], *,
                      warn_as: tuple[str, str] | None = None) -> dict[str, Any]:
    """``data`` with the options written as top-level keys (the layout before ``options``
    existed) moved into its ``options``, over any it already holds.

    Args:
        data: Draft config fields (a saved config, or a run's overrides).
        warn_as: Where such keys were written and where they go now (e.g.
            ``("model.draft.overrides", "model.draft.options")``): a ``FutureWarning`` names
            both and the version that stops reading the old place. None: no warning (a saved
            checkpoint or export keeps loading).
    """
    defaults = _option_defaults()
    flat = [name for name in data if name in defaults]
    if not flat:
        return dict(data)
    if warn_as is not None:
        old, new = warn_as
        what = ("is one of the architecture's options: write it" if len(flat) == 1
                else "are the architecture's options: write them")
        warnings.warn(f"{old}: {', '.join(flat)} {what} under {new} (no longer read from {old} "
                      f"from sparkforge {LEGACY_DROPPED_IN})", FutureWarning, stacklevel=3)
    out = {k: v for k, v in data.items() if k not in defaults}
    out["options"] = {**options_dict(data.get("options")), **{k: data[k] for k in flat}}
    return out


def from_target_config(
    target_config: Any,
    *,
    mask_token_id: int,
    target_layer_ids: Sequence[int] | None = None,
    **overrides: Any,
) -> DraftConfig:
    """Derive a draft config from a target HF config (nested ``text_config`` handled).

    The generic sizes come from ``target_fields``; the named architecture copies its own
    options from the target too (deepseek_v4, kimi_k3), and ``options`` in ``overrides``
    changes some of them, keeping the rest.

    Args:
        target_config: A transformers ``PretrainedConfig`` of the target (or any object whose
            attributes are its ``config.json`` fields).
        mask_token_id: Required; never defaulted to the pad id.
        target_layer_ids: Feature ids; default = DFlash rule for the draft depth.
        **overrides: Any draft config field (num_hidden_layers, block_size, markov_rank,
            options, ...). An option given as a keyword of its own still reads, warning.
    """
    overrides = fold_flat_options(overrides, warn_as=("from_target_config's keywords",
                                                      "options={...}"))
    base = target_fields(target_config, depth=int(overrides.get("num_hidden_layers", 5)))
    rules = rules_of(overrides.get("architecture") or "qwen3")
    base |= rules.target_fields(text_config(target_config), target_model_type(target_config))
    if target_layer_ids is not None:
        base["target_layer_ids"] = tuple(target_layer_ids)
    if "options" in overrides and "options" in base:
        overrides["options"] = {**base["options"], **options_dict(overrides["options"])}
    return DraftConfig(**{**base, **overrides}, mask_token_id=mask_token_id)


RENAMED = {"DSparkDraftConfig": "DraftConfig"}
"""Old names this module still serves, each as its new name (``renamed_attribute``)."""


def __getattr__(name: str) -> Any:
    """An old name of ``RENAMED``, with a FutureWarning naming its replacement."""
    return renamed_attribute(__name__, name, RENAMED)
