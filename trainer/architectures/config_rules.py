"""What the draft config asks of each architecture: its name, options class, checks and target
derivation.

``DraftConfig`` (``config.py``) reads an architecture's options, runs its checks and derives
them from a target through ``CONFIG_RULES``; the table (``ARCHITECTURES``) reads the same
entries. Both import this module, which imports neither, so the config and the table do not
import each other. An architecture without options of its own has no entry (``rules_of``
gives ``NO_RULES``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from sparkforge.trainer.architectures.deepseek_v4 import config as deepseek_v4_config
from sparkforge.trainer.architectures.kimi_k3 import config as kimi_k3_config
from sparkforge.trainer.architectures.options import ArchitectureOptions

if TYPE_CHECKING:
    from sparkforge.trainer.architectures.config import DraftConfig

Architecture = Literal["qwen3", "deepseek_v4", "gemma4", "kimi_k3"]
"""The draft architectures (backbones), each a folder of ``sparkforge.trainer.architectures``."""


def _no_problems(cfg: DraftConfig) -> list[str]:
    return []


def _no_target_fields(tc: Any, model_type: str) -> dict[str, Any]:
    return {}


@dataclass(frozen=True, kw_only=True)
class ConfigRules:
    """How the draft config reads one architecture's own fields."""

    options: type[ArchitectureOptions] | None = None
    """The class of the config's ``options``: the fields only this architecture reads (None:
    it has none)."""
    problems: Callable[[DraftConfig], list[str]] = _no_problems
    """This architecture's own config checks (run by ``DraftConfig``, once its ``options``
    are this architecture's)."""
    target_fields: Callable[[Any, str], dict[str, Any]] = _no_target_fields
    """The fields it copies from a target's text config (and its ``model_type``): its
    ``options`` and the generic fields they fix."""


NO_RULES = ConfigRules()
"""The rules of an architecture without options of its own: no checks, nothing copied."""

CONFIG_RULES: Mapping[Architecture, ConfigRules] = {
    "deepseek_v4": ConfigRules(options=deepseek_v4_config.DeepseekV4Options,
                               problems=deepseek_v4_config.problems,
                               target_fields=deepseek_v4_config.target_fields),
    "kimi_k3": ConfigRules(options=kimi_k3_config.KimiK3Options,
                           problems=kimi_k3_config.problems,
                           target_fields=kimi_k3_config.target_fields),
}
"""The architectures with options of their own, and how the config reads them."""


def rules_of(architecture: str | None) -> ConfigRules:
    """The config rules of ``architecture`` (``NO_RULES`` for one without options, or for a
    name that is no architecture: the config's checks name that)."""
    return CONFIG_RULES.get(cast(Architecture, architecture), NO_RULES)
