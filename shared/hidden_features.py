"""Turn one HF ``hidden_states`` entry into a DSpark feature, as the target's family defines it.

The producer's HF backend and the trainer's online evaluation both read features from a plain
transformers forward; this keeps the two on one definition, including the last layer's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.target_families import TargetFamily


def layer_feature(hidden: torch.Tensor, family: TargetFamily) -> torch.Tensor:
    """The feature ``[B, S, H]`` of one HF ``hidden_states`` entry.

    A hyper-connection target (DeepSeek-V4) returns ``[B, S, hc_mult, H]`` per layer; its feature
    is the mean over the streams, what vLLM's aux capture feeds a V4 draft.

    Raises:
        ValueError: When the entry's rank does not fit the family's feature semantics.
    """
    want = 4 if family.features == "hc_mean" else 3
    if hidden.dim() != want:
        raise SparkforgeError(
            f"{family.name} target: a hidden_states entry has shape "
            f"{tuple(hidden.shape)}, expected {want} dims for {family.features!r} "
            "features")
    return hidden.mean(dim=2) if family.features == "hc_mean" else hidden


@contextmanager
def served_hidden_states(
    model: Any,
) -> Iterator[Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]]:
    """Within the block, map a forward's HF ``hidden_states`` to the states vLLM's aux ids hold.

    HF's entry ``L`` is the lm_head input (after the final norm, and for DeepSeek-V4 after
    ``hc_head``); vLLM's aux id ``L``, which serves feature id ``L - 1``, is the last decoder
    layer's raw output. A forward hook on that layer records it for the yielded function, which
    returns the entries with ``L`` replaced (every other entry is already the same tensor).

    Raises:
        ValueError: When the model has no ``get_decoder().layers``, or a forward's
            ``hidden_states`` do not hold one entry per layer plus the embeddings.
    """
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise SparkforgeError(
            f"{type(model).__name__}: no decoder layers (get_decoder().layers) to "
            "read the last layer's output from")
    last: list[torch.Tensor] = []

    def keep(_module: Any, _args: Any, output: Any) -> None:
        last[:] = [output[0] if isinstance(output, tuple) else output]

    def served(hidden_states: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(hidden_states) != len(layers) + 1 or not last:
            raise SparkforgeError(
                f"{len(hidden_states)} hidden_states for {len(layers)} decoder "
                "layers (expected one per layer plus the embeddings, after a forward)")
        return [*hidden_states[:-1], last[0]]

    handle = layers[-1].register_forward_hook(keep)
    try:
        yield served
    finally:
        handle.remove()
