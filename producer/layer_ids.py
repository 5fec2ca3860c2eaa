"""The one place that converts layer ids between DSpark, HF ``hidden_states`` and vLLM conventions.

DSpark feature id ``l`` is the output of 0-based decoder layer ``l``, which is HF
``hidden_states[l + 1]`` and vLLM aux id ``l + 1`` (vllm-capture.md section 5). Feature ids stay in
``[0, L - 2]`` so every convention and serving engine agrees (dspark-algorithm.md section 3.2).
The final state is captured as vLLM aux id ``L`` (pre-norm) and normalised offline.
"""

from __future__ import annotations

from collections.abc import Sequence

from sparkforge.manifests.contract import default_target_layer_ids


class LayerIdError(ValueError):
    """Raised when layer ids are out of range, unsorted, duplicated or empty."""


def validate_feature_ids(feature_ids: Sequence[int], num_hidden_layers: int) -> tuple[int, ...]:
    """Check DSpark feature ids: non-empty, strictly increasing, each in ``[0, L - 2]``.

    Args:
        feature_ids: DSpark ids (output of 0-based decoder layer ``l``).
        num_hidden_layers: The target's ``num_hidden_layers`` (L).

    Returns:
        The ids as a tuple.

    Raises:
        LayerIdError: Naming every offending id and the allowed range.
    """
    ids = tuple(int(i) for i in feature_ids)
    top = num_hidden_layers - 2
    problems = []
    if not ids:
        problems.append("the list is empty")
    if top < 0:
        problems.append(f"num_hidden_layers={num_hidden_layers} leaves no valid feature id")
    bad = [i for i in ids if not 0 <= i <= top]
    if bad:
        problems.append(
            f"ids {bad} are outside [0, {top}] (L={num_hidden_layers}; the last layer's output "
            "is pre-norm in vLLM and post-norm in HF, so it is never a feature)"
        )
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        problems.append(f"ids {list(ids)} are not strictly increasing")
    if problems:
        raise LayerIdError("invalid target_layer_ids: " + "; ".join(problems))
    return ids


def default_feature_ids(num_hidden_layers: int, num_features: int) -> tuple[int, ...]:
    """DFlash default ids for a target depth, as DSpark ids, validated.

    The rule (evenly spaced in ``[1, L - 3]``) lives in ``manifests.contract`` so the producer and
    the trainer can never disagree on it; L=36, n=5 gives ``(1, 9, 17, 25, 33)``.
    """
    ids = default_target_layer_ids(num_hidden_layers, num_features)
    return validate_feature_ids(ids, num_hidden_layers)


def feature_to_hf(feature_ids: Sequence[int]) -> tuple[int, ...]:
    """DSpark feature id ``l`` -> HF ``hidden_states`` index (= vLLM aux id) ``l + 1``."""
    return tuple(int(i) + 1 for i in feature_ids)


def hf_to_feature(hf_ids: Sequence[int]) -> tuple[int, ...]:
    """HF ``hidden_states`` index ``k`` -> DSpark feature id ``k - 1``."""
    return tuple(int(i) - 1 for i in hf_ids)


def validate_hf_ids(hf_ids: Sequence[int], num_hidden_layers: int) -> tuple[int, ...]:
    """Check captured HF indices: strictly increasing, each in ``[1, L - 1]``.

    Raises:
        LayerIdError: As :func:`validate_feature_ids`, in the HF convention.
    """
    try:
        validate_feature_ids(hf_to_feature(hf_ids), num_hidden_layers)
    except LayerIdError as exc:
        raise LayerIdError(
            f"invalid capture layer_ids {list(hf_ids)} (HF hidden_states indices, allowed "
            f"[1, {num_hidden_layers - 1}], strictly increasing): {exc}"
        ) from exc
    return tuple(int(i) for i in hf_ids)


def vllm_aux_ids(hf_ids: Sequence[int], num_hidden_layers: int) -> tuple[int, ...]:
    """The aux ids to request from vLLM: sorted unique ``hf_ids`` plus ``L`` (pre-norm final).

    vLLM sorts and de-duplicates the ids itself (DeepSeek-V2/V3 does not), so they are passed in
    the order the file slots come back in.
    """
    return tuple(sorted(set(validate_hf_ids(hf_ids, num_hidden_layers)) | {num_hidden_layers}))
