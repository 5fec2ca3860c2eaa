"""The target's HF ``config.json``, read one way by every stage (torch-free).

Multimodal checkpoints nest the text model's settings under ``text_config``;
``TargetConfig.text`` lifts them over the top level, so sizes are found the same way everywhere.
``model_type`` stays the top-level one (the checkpoint's own architecture).

Gemma4 sizes attention per layer: its full-attention layers take ``head_dim`` and
``num_key_value_heads`` from ``per_layer_config`` (the checkpoint's ``global_head_dim`` and
``num_global_key_value_heads``), its top-level ``head_dim`` is the sliding layers' one, and its
``rope_parameters`` are keyed by layer type. ``TargetConfig.attention`` lifts the full-attention
settings, which is what a draft's (full-attention) layers copy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.fields import MAX_DEPTH, json_depth, shorten
from sparkforge.shared.target_families import family_of

FULL_ATTENTION = "full_attention"
"""The ``layer_types`` entry of a global (not sliding-window) attention layer."""


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

    @property
    def attention(self) -> dict[str, Any]:
        """``text`` with the settings of the target's full-attention layers lifted over it.

        The per-layer overrides of the first ``full_attention`` layer (``per_layer_config``,
        keyed by layer index; without it ``global_head_dim`` and, under ``attention_k_eq_v``,
        ``num_global_key_value_heads``) replace the global sizes, and ``rope_parameters`` keyed
        by layer type become the ``full_attention`` entry. Other configs read as ``text``.
        """
        text = self.text
        out = dict(text)
        layer_types = text.get("layer_types")
        per_layer = text.get("per_layer_config")
        override = None
        if isinstance(layer_types, list) and FULL_ATTENTION in layer_types and isinstance(
                per_layer, Mapping):
            index = layer_types.index(FULL_ATTENTION)
            override = per_layer.get(str(index), per_layer.get(index))
        if isinstance(override, Mapping):
            out.update(override)
        else:  # the checkpoint's own spelling, before transformers builds per_layer_config
            if text.get("global_head_dim") is not None:
                out["head_dim"] = text["global_head_dim"]
            if text.get("num_global_key_value_heads") is not None and text.get(
                    "attention_k_eq_v") is not False:
                out["num_key_value_heads"] = text["num_global_key_value_heads"]
        rope = text.get("rope_parameters")
        if isinstance(rope, Mapping) and isinstance(rope.get(FULL_ATTENTION), Mapping):
            out["rope_parameters"] = dict(rope[FULL_ATTENTION])
        return out

    def head_dim(self) -> int:
        """Per-head size of the full-attention layers (``hidden_size / heads`` when unset).

        Raises:
            ValueError: naming the source and the field when a size is not a positive integer.
        """
        value = self.attention.get("head_dim")
        if value is None:
            return self.positive_int("hidden_size") // self.positive_int("num_attention_heads")
        return _positive(value, "head_dim", self.source)

    @property
    def embedding_scale(self) -> float:
        """Multiplier on the embedding output: sqrt(hidden_size) for Gemma targets, else 1."""
        if family_of(self.model_type).embedding_scale_sqrt_hidden:
            return math.sqrt(self.positive_int("hidden_size"))
        return 1.0

    @property
    def final_logit_softcapping(self) -> float | None:
        """The tanh cap on the lm_head logits (Gemma), or None when the target has none.

        Raises:
            ValueError: naming the source when the cap is not a positive number.
        """
        value = self.text.get("final_logit_softcapping")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise SparkforgeError(f"{self.source}: config field final_logit_softcapping must be a "
                                  f"positive number or null, got {value!r}")
        return float(value)

    def positive_int(self, name: str) -> int:
        """A size of the text model, e.g. ``hidden_size``.

        Raises:
            ValueError: naming the source, the field and the value found.
        """
        return _positive(self.text.get(name), name, self.source)


def _positive(value: object, name: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SparkforgeError(f"{source}: config field {name} must be a positive integer, "
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
        raise SparkforgeError(f"{source}: not valid JSON ({shorten(str(exc))})") from exc
    except RecursionError as exc:
        raise SparkforgeError(f"{source}: JSON nested deeper than {MAX_DEPTH} levels") from exc
    if json_depth(raw) > MAX_DEPTH:
        raise SparkforgeError(f"{source}: JSON nested deeper than {MAX_DEPTH} levels")
    if not isinstance(raw, dict):
        raise SparkforgeError(f"{source}: expected a JSON object")
    return TargetConfig(raw=raw, source=source)


def read_target_config(model_dir: str | Path) -> TargetConfig:
    """The ``config.json`` of a local checkpoint folder."""
    path = Path(model_dir) / "config.json"
    return parse_target_config(path.read_bytes(), str(path))
