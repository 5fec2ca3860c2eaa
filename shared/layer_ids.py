"""Layer ids: DSpark feature ids vs HF ``hidden_states`` indices, one range rule, one default.

Two conventions name the same tensors, so they get distinct types:

- a **feature id** ``l`` (``FeatureIds``; the draft's ``target_layer_ids`` and the producer's
  ``--layer_ids``) is the output of 0-based decoder layer ``l``;
- an **HF index** ``k`` (``HfIndices``; the cache's ``capture.layer_ids`` and the capture sources'
  ``layer_ids``) is ``hidden_states[k]``, the residual stream after ``k`` decoder layers, which is
  also vLLM's aux id ``k``. Feature id ``l`` is HF index ``l + 1``.

Range rule, for a target of ``L`` decoder layers: HF indices ``[0, L]`` exist (0 is the embedding
output, L the final state), i.e. feature ids ``[-1, L - 1]``. Only feature ids ``[0, L - 2]``
(HF ``[1, L - 1]``) mean the same thing in every engine: vLLM serves the last layer's output
pre-norm and HF post-norm, so ``L - 1`` is never a portable feature, and ``-1`` is no layer's
output. The producer captures only portable ids; the trainer accepts any existing one and warns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

FeatureIds = NewType("FeatureIds", tuple[int, ...])
"""DSpark feature ids: id ``l`` is the output of 0-based decoder layer ``l``."""
HfIndices = NewType("HfIndices", tuple[int, ...])
"""HF ``hidden_states`` indices (= vLLM aux ids): index ``k`` follows ``k`` decoder layers."""


class LayerIdError(ValueError):
    """Raised when layer ids are out of range, unsorted, duplicated or empty."""


def feature_to_hf(feature_ids: Sequence[int]) -> HfIndices:
    """Feature id ``l`` -> HF ``hidden_states`` index ``l + 1``."""
    return HfIndices(tuple(int(i) + 1 for i in feature_ids))


def hf_to_feature(hf_ids: Sequence[int]) -> FeatureIds:
    """HF ``hidden_states`` index ``k`` -> feature id ``k - 1``."""
    return FeatureIds(tuple(int(i) - 1 for i in hf_ids))


def hidden_states_range(num_hidden_layers: int) -> tuple[int, int]:
    """Inclusive range of the HF indices a target of ``L`` layers has: ``[0, L]``."""
    return 0, num_hidden_layers


def existing_feature_range(num_hidden_layers: int) -> tuple[int, int]:
    """Inclusive range of feature ids with an HF index: ``[-1, L - 1]``."""
    lo, hi = hidden_states_range(num_hidden_layers)
    return lo - 1, hi - 1


def portable_feature_range(num_hidden_layers: int) -> tuple[int, int]:
    """Inclusive range of feature ids every engine serves alike: ``[0, L - 2]``."""
    return 0, num_hidden_layers - 2


def range_problems(ids: Sequence[int], bounds: tuple[int, int], *, name: str) -> list[str]:
    """Every way ``ids`` fail to be a non-empty, strictly increasing list inside ``bounds``."""
    ids, (lo, hi) = [int(i) for i in ids], bounds
    if not ids:
        return [f"{name} must be non-empty"]
    problems = []
    bad = [i for i in ids if not lo <= i <= hi]
    if bad:
        problems.append(f"{name}: ids {bad} are outside [{lo}, {hi}]")
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        problems.append(f"{name}={ids} must be strictly increasing")
    return problems


def check_feature_ids(feature_ids: Sequence[int], num_hidden_layers: int) -> FeatureIds:
    """Portable feature ids: non-empty, strictly increasing, each in ``[0, L - 2]``.

    Raises:
        LayerIdError: naming every offending id and the allowed range.
    """
    bounds = portable_feature_range(num_hidden_layers)
    problems = range_problems(feature_ids, bounds, name="target_layer_ids")
    if problems:
        raise LayerIdError("; ".join(problems) + f" (L={num_hidden_layers}; the last layer's "
                           "output is pre-norm in vLLM and post-norm in HF, so it is never a "
                           "feature)")
    return FeatureIds(tuple(int(i) for i in feature_ids))


def check_hf_ids(hf_ids: Sequence[int], num_hidden_layers: int) -> HfIndices:
    """Captured HF indices of portable features: strictly increasing, each in ``[1, L - 1]``.

    Raises:
        LayerIdError: as :func:`check_feature_ids`, in the HF convention.
    """
    try:
        return feature_to_hf(check_feature_ids(hf_to_feature(hf_ids), num_hidden_layers))
    except LayerIdError as exc:
        raise LayerIdError(
            f"invalid capture layer_ids {list(hf_ids)} (HF hidden_states indices, allowed "
            f"[1, {num_hidden_layers - 1}], strictly increasing): {exc}") from exc


def vllm_aux_ids(hf_ids: Sequence[int], num_hidden_layers: int) -> HfIndices:
    """The aux ids to request from vLLM: sorted unique ``hf_ids`` plus ``L`` (pre-norm final).

    vLLM sorts and de-duplicates the ids itself (DeepSeek-V2/V3 does not), so they are passed in
    the order the file slots come back in.
    """
    ids = set(check_hf_ids(hf_ids, num_hidden_layers)) | {num_hidden_layers}
    return HfIndices(tuple(sorted(ids)))


def default_feature_ids(num_hidden_layers: int, num_features: int) -> FeatureIds:
    """DFlash rule: n ids evenly spaced in [1, L-3], round(1 + i*(L-4)/(n-1)) (half-even).

    Chosen over NeMo's [1, L-1] rule because it never includes the last layer (L=36 ->
    [1,9,17,25,33], DeepSpec's released Qwen3-4B/8B ids). Small targets fall back to [0, L-2].
    The producer's default capture and the trainer's default draft both come from here.
    """
    top = num_hidden_layers - 3
    n = max(1, num_features)
    if top < 1:
        return FeatureIds(tuple(range(max(0, num_hidden_layers - 1)))[:n] or (0,))
    n = min(n, top)
    if n == 1:
        return FeatureIds((top,))
    step = (top - 1) / (n - 1)
    return FeatureIds(tuple(sorted({round(1 + i * step) for i in range(n)})))
