"""Turn one HF ``hidden_states`` entry into a DSpark feature, as the target's family defines it.

The producer's HF backend and the trainer's online evaluation both read features from a plain
transformers forward; this keeps the two on one definition.
"""

from __future__ import annotations

import torch

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
        raise ValueError(f"{family.name} target: a hidden_states entry has shape "
                         f"{tuple(hidden.shape)}, expected {want} dims for {family.features!r} "
                         "features")
    return hidden.mean(dim=2) if family.features == "hc_mean" else hidden
