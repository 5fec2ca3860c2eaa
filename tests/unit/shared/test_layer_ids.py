"""Layer-id conversions between DSpark feature ids, HF hidden_states indices and vLLM aux ids."""

from __future__ import annotations

import pytest

from sparkforge.shared.layer_ids import (
    LayerIdError,
    check_feature_ids,
    check_hf_ids,
    default_feature_ids,
    feature_to_hf,
    hf_to_feature,
    vllm_aux_ids,
)


@pytest.mark.parametrize(
    ("num_layers", "num_features", "expected"),
    [(36, 5, (1, 9, 17, 25, 33)), (40, 5, (1, 10, 19, 28, 37)), (28, 3, (1, 13, 25)),
     (28, 1, (25,)), (36, 1, (33,)), (4, 2, (1,)), (4, 3, (1,)), (3, 2, (0, 1)), (2, 5, (0,))],
)
def test_default_ids_follow_the_dflash_rule(num_layers, num_features, expected) -> None:
    """Defaults are round(1 + i (L-4)/(n-1)) in [1, L-3] (DeepSpec's Qwen3 ids), [0, L-2] tiny."""
    assert default_feature_ids(num_layers, num_features) == expected


@pytest.mark.parametrize("num_layers", [2, 3, 4, 5, 8, 28, 61])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_default_ids_sorted_in_range_sized(num_layers: int, n: int) -> None:
    """Default ids are strictly increasing, in [0, L-2], and n of them when L allows."""
    ids = default_feature_ids(num_layers, n)
    assert list(ids) == sorted(set(ids))
    assert all(0 <= i <= num_layers - 2 for i in ids)
    assert len(ids) == min(n, max(1, num_layers - 3)) or num_layers < 4


def test_feature_and_hf_ids_differ_by_one() -> None:
    """DSpark id l is HF hidden_states[l + 1] and back."""
    assert feature_to_hf([0, 5, 34]) == (1, 6, 35)
    assert hf_to_feature(feature_to_hf([0, 5, 34])) == (0, 5, 34)


def test_vllm_aux_ids_add_the_final_layer_sorted() -> None:
    """The engine is asked for the captured ids plus L (pre-norm final), ascending."""
    assert vllm_aux_ids([1, 9, 17], 36) == (1, 9, 17, 36)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([], "empty"),
        ([0, 35], r"outside \[0, 34\]"),
        ([-1, 3], "outside"),
        ([3, 3], "strictly increasing"),
        ([5, 2], "strictly increasing"),
    ],
)
def test_bad_feature_ids_are_rejected(ids, match) -> None:
    """Feature ids must be non-empty, strictly increasing and in [0, L-2]."""
    with pytest.raises(LayerIdError, match=match):
        check_feature_ids(ids, 36)


def test_bad_hf_ids_name_the_hf_range() -> None:
    """Captured HF indices outside [1, L-1] are rejected with the HF range in the message."""
    with pytest.raises(LayerIdError, match=r"allowed \[1, 35\]"):
        check_hf_ids([0, 4], 36)
    with pytest.raises(LayerIdError, match="outside"):
        check_hf_ids([36], 36)
