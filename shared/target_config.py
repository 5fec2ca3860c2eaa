"""The target's HF ``config.json``, read one way by every stage (torch-free).

Multimodal checkpoints nest the text model's settings under ``text_config``;
``TargetConfig.text`` lifts them over the top level, so sizes are found the same way everywhere.
``model_type`` stays the top-level one (the checkpoint's own architecture).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkforge.shared.fields import MAX_DEPTH, json_depth, shorten


@dataclass(frozen=True)
class TargetConfig:
    """A parsed ``config.json`` and where it came from (named in every error)."""

    raw: Mapping[str, Any]
    """The whole JSON object, nested sections included."""
    source: str
    """The file or object it was read from."""

    @property
    def text(self) -> dict[str, Any]:
        """The text model's settings: ``text_config`` (multimodal) lifted over the top level."""
        nested = self.raw.get("text_config")
        return {**self.raw, **nested} if isinstance(nested, Mapping) else dict(self.raw)

    @property
    def model_type(self) -> str | None:
        """The top-level ``model_type``."""
        value = self.raw.get("model_type")
        return value if isinstance(value, str) else None

    def positive_int(self, name: str) -> int:
        """A size of the text model, e.g. ``hidden_size``.

        Raises:
            ValueError: naming the source, the field and the value found.
        """
        value = self.text.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{self.source}: config field {name} must be a positive integer, "
                             f"got {value!r}")
        return value


def parse_target_config(data: bytes | str, source: str) -> TargetConfig:
    """Parse ``config.json`` text.

    Raises:
        ValueError: The text is not JSON, is nested deeper than :data:`MAX_DEPTH`, or is not a
            JSON object.
    """
    try:
        raw = json.loads(data)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON ({shorten(str(exc))})") from exc
    except RecursionError as exc:
        raise ValueError(f"{source}: JSON nested deeper than {MAX_DEPTH} levels") from exc
    if json_depth(raw) > MAX_DEPTH:
        raise ValueError(f"{source}: JSON nested deeper than {MAX_DEPTH} levels")
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object")
    return TargetConfig(raw=raw, source=source)


def read_target_config(model_dir: str | Path) -> TargetConfig:
    """The ``config.json`` of a local checkpoint folder."""
    path = Path(model_dir) / "config.json"
    return parse_target_config(path.read_bytes(), str(path))
