"""``sparkforge plan``'s layer flags: the HF indices a planned cache records.

``--layer_ids`` and ``--layer_stride`` take feature ids (id ``l``: the output of 0-based decoder
layer ``l``, HF ``hidden_states`` index ``l + 1``), as ``sparkforge produce`` and the drafts'
``target_layer_ids`` do, checked by the producer's own rule.
"""

from __future__ import annotations

from sparkforge.shared.errors import ConfigError
from sparkforge.shared.layer_ids import (
    LayerIdError,
    check_feature_ids,
    feature_to_hf,
    strided_feature_ids,
)


def capture_ids(*, layer_ids: str | None, layer_stride: int | None, layer_start: int,
                num_layers: int | None) -> list[int] | None:
    """The HF indices of the capture the flag given describes; None when none is (the plan
    then counts ``--num_aux_layers``). ``num_layers`` is the target's (None: unknown).

    Raises:
        ConfigError: naming the flag and what it must hold.
    """
    if layer_ids:
        return list(feature_to_hf(_feature_ids(layer_ids, num_layers)))
    return None if layer_stride is None else _strided_ids(layer_stride, layer_start, num_layers)


def _feature_ids(text: str, num_layers: int | None) -> list[int]:
    """``--layer_ids``: feature ids, checked by the rule ``sparkforge produce`` applies."""
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError as exc:
        raise ConfigError(f"--layer_ids must be comma-separated integers, got {text!r}") from exc
    if num_layers is None:
        if min(ids) >= 0 and ids == sorted(set(ids)):
            return ids
        raise ConfigError(f"--layer_ids {ids}: feature ids must be >= 0 and strictly increasing")
    try:
        return list(check_feature_ids(ids, num_layers))
    except LayerIdError as exc:
        raise ConfigError(f"--layer_ids {ids} for a {num_layers}-layer target (feature ids, as "
                          f"sparkforge produce takes them; HF hidden_states index = id + 1): "
                          f"{exc}") from exc


def _strided_ids(stride: int, start: int, num_layers: int | None) -> list[int]:
    """HF indices of the ``--layer_stride`` capture (the producer's rule)."""
    if num_layers is None:
        raise ConfigError("--layer_stride needs --target_config (the number of layers)")
    try:
        return list(feature_to_hf(strided_feature_ids(num_layers, stride, start=start)))
    except LayerIdError as exc:
        raise ConfigError(f"--layer_stride / --layer_start: {exc}") from exc
