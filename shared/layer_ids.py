"""Layer ids: DSpark feature ids vs HF ``hidden_states`` indices, one range rule, one default.

Two conventions name the same tensors, so they get distinct types:

- a **feature id** ``l`` (``FeatureIds``; the draft's ``target_layer_ids`` and the producer's
  ``--layer_ids``) is the output of 0-based decoder layer ``l``;
- an **HF index** ``k`` (``HfIndices``; the cache's ``capture.layer_ids`` and the capture sources'
  ``layer_ids``) is ``hidden_states[k]``, the residual stream after ``k`` decoder layers, which is
  also vLLM's aux id ``k``. Feature id ``l`` is HF index ``l + 1``.

Range rule, for a target of ``L`` decoder layers: HF indices ``[0, L]`` exist (0 is the embedding
output), i.e. feature ids ``[-1, L - 1]``. Index ``L`` here means the last decoder layer's raw
output, before the final norm (for DeepSeek-V4 the mean of its streams before ``hc_head``): that
is vLLM's aux id ``L``, the feature vLLM serves for id ``L - 1``. HF's own ``hidden_states[L]``
is the lm_head input instead, so both capture backends read index ``L`` from the last layer's
output (``sparkforge.shared.hidden_features``), and the cache's final state is separate.

- **Portable** feature ids ``[0, L - 1]`` (HF ``[1, L]``): the producer captures them and a
  draft trained on them sees at serve time what it saw in training.
- Id ``-1`` (the embeddings) is no layer's output and SGLang cannot capture it: never captured.
- Id ``L - 1`` is portable but SGLang cannot capture it either, so defaults and stride captures
  stay in ``[0, L - 2]`` (``every_engine_feature_range``) and the export names the engines that
  cannot serve a draft using it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.fields import shorten

FeatureIds = NewType("FeatureIds", tuple[int, ...])
"""DSpark feature ids: id ``l`` is the output of 0-based decoder layer ``l``."""
HfIndices = NewType("HfIndices", tuple[int, ...])
"""HF ``hidden_states`` indices (= vLLM aux ids): index ``k`` follows ``k`` decoder layers."""


class LayerIdError(SparkforgeError):
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
    """Inclusive range of feature ids captured as vLLM serves them: ``[0, L - 1]``."""
    return 0, num_hidden_layers - 1


def every_engine_feature_range(num_hidden_layers: int) -> tuple[int, int]:
    """Inclusive range of portable feature ids SGLang can capture too: ``[0, L - 2]``."""
    return 0, num_hidden_layers - 2


def range_problems(ids: Sequence[int], bounds: tuple[int, int], *, name: str) -> list[str]:
    """Every way ``ids`` fail to be a non-empty, strictly increasing list inside ``bounds``."""
    ids, (lo, hi) = [int(i) for i in ids], bounds
    if not ids:
        return [f"{name} must be non-empty"]
    problems = []
    bad = [i for i in ids if not lo <= i <= hi]
    if bad:
        problems.append(f"{name}: ids {shorten(str(bad))} are outside [{lo}, {hi}]")
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        problems.append(f"{name}={shorten(str(ids))} must be strictly increasing")
    return problems


def check_feature_ids(feature_ids: Sequence[int], num_hidden_layers: int) -> FeatureIds:
    """Portable feature ids: non-empty, strictly increasing, each in ``[0, L - 1]``.

    Raises:
        LayerIdError: naming every offending id and the allowed range.
    """
    bounds = portable_feature_range(num_hidden_layers)
    problems = range_problems(feature_ids, bounds, name="target_layer_ids")
    if problems:
        raise LayerIdError("; ".join(problems) + f" (L={num_hidden_layers}; id -1, the "
                           "embeddings, is no layer's output)")
    return FeatureIds(tuple(int(i) for i in feature_ids))


def check_hf_ids(hf_ids: Sequence[int], num_hidden_layers: int) -> HfIndices:
    """Captured HF indices of portable features: strictly increasing, each in ``[1, L]``.

    Raises:
        LayerIdError: as :func:`check_feature_ids`, in the HF convention.
    """
    try:
        return feature_to_hf(check_feature_ids(hf_to_feature(hf_ids), num_hidden_layers))
    except LayerIdError as exc:
        raise LayerIdError(
            f"invalid capture layer_ids {list(hf_ids)} (HF hidden_states indices, allowed "
            f"[1, {num_hidden_layers}], strictly increasing): {exc}") from exc


def vllm_aux_ids(hf_ids: Sequence[int], num_hidden_layers: int) -> HfIndices:
    """The aux ids to request from vLLM: sorted unique ``hf_ids`` plus ``L`` (pre-norm final).

    Aux id ``L`` is the last layer's raw output: the source of the final state and, when
    ``hf_ids`` holds ``L``, of feature ``L - 1`` too.

    vLLM sorts and de-duplicates the ids itself (DeepSeek-V2/V3 does not), so they are passed in
    the order the file slots come back in.
    """
    ids = set(check_hf_ids(hf_ids, num_hidden_layers)) | {num_hidden_layers}
    return HfIndices(tuple(sorted(ids)))


def strided_feature_ids(num_hidden_layers: int, stride: int, *, start: int = 1) -> FeatureIds:
    """Every ``stride``-th feature id from ``start`` up to ``L - 2``: a superset capture.

    The default start 1 is the DFlash rule's first id, so a stride dividing its spacing holds the
    default draft ids (L=36: stride 8 -> [1, 9, 17, 25, 33], stride 4 adds the ids between).

    Raises:
        LayerIdError: ``stride`` < 1, or ``start`` outside ``[0, L - 2]``.
    """
    if stride < 1:
        raise LayerIdError(f"layer_stride must be >= 1, got {stride}")
    _, hi = every_engine_feature_range(num_hidden_layers)
    return check_feature_ids(range(start, hi + 1, stride) if start >= 0 else [start],
                             num_hidden_layers)


def default_feature_ids(num_hidden_layers: int, num_features: int) -> FeatureIds:
    """DFlash rule: n ids evenly spaced in [1, L-3], round(1 + i*(L-4)/(n-1)) (half-even).

    Chosen over NeMo's [1, L-1] rule because it never includes the last layer, which SGLang
    cannot capture (L=36 -> [1,9,17,25,33], DeepSpec's released Qwen3-4B/8B ids). Small
    targets fall back to [0, L-2].
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


def missing_features(held_hf: Sequence[int], wanted: Sequence[int]) -> FeatureIds:
    """The feature ids in ``wanted`` whose HF index is not among the captured ``held_hf``."""
    held = set(int(i) for i in held_hf)
    return FeatureIds(tuple(int(w) for w, k in zip(wanted, feature_to_hf(wanted), strict=True)
                            if k not in held))


def feature_positions(held_hf: Sequence[int], wanted: Sequence[int]) -> tuple[int, ...]:
    """Where each feature id of ``wanted`` sits in a cache capturing HF indices ``held_hf``.

    A draft may use any subset of the captured features; position ``p`` is the index along
    ``aux_hidden``'s layer axis, in ``wanted``'s order.

    Raises:
        LayerIdError: naming the wanted feature ids the cache does not hold.
    """
    missing = missing_features(held_hf, wanted)
    if missing:
        raise LayerIdError(
            f"feature ids {list(missing)} (HF indices {list(feature_to_hf(missing))}) are not "
            f"captured; the cache holds HF indices {list(held_hf)}")
    where = {int(k): p for p, k in enumerate(held_hf)}
    return tuple(where[k] for k in feature_to_hf(wanted))
