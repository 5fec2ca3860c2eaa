"""An architecture's options: the draft config fields only that architecture reads.

The draft config (``DraftConfig``) holds them as one object, ``options``, of the class its
architecture's entry names (``DraftArchitecture.options``; each class lives in the
architecture's own ``config.py``), so the generic config names none of them. An architecture
without options of its own has ``options: None``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from sparkforge.shared.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ArchitectureOptions:
    """Base of every architecture's options class (a frozen keyword-only dataclass)."""


OptionsT = TypeVar("OptionsT", bound=ArchitectureOptions)


def options_of(cfg: Any, kind: type[OptionsT]) -> OptionsT:
    """``cfg.options``, typed as the ``kind`` its architecture reads.

    Raises:
        ConfigError: the config holds other options (it names another architecture).
    """
    got = getattr(cfg, "options", None)
    if not isinstance(got, kind):
        raise ConfigError(f"architecture={getattr(cfg, 'architecture', None)!r}: expected "
                          f"{kind.__name__} options, got {got!r}")
    return got


def options_dict(options: Any) -> dict[str, Any]:
    """An options value as a plain dict: a mapping's items, an options object's fields, or
    nothing for None."""
    if options is None:
        return {}
    if isinstance(options, ArchitectureOptions):
        return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    if isinstance(options, Mapping):
        return dict(options)
    raise ConfigError(f"options={options!r} must be a mapping of option names to values")
