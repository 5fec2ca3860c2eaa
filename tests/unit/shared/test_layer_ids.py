"""Layer-id conversions between DSpark feature ids, HF hidden_states indices and vLLM aux ids."""

from __future__ import annotations

import pytest

from sparkforge.shared.layer_ids import (
    LayerIdError,
    check_feature_ids,
    check_hf_ids,
    default_feature_ids,
    feature_positions,
    feature_to_hf,
    hf_to_feature,
    missing_features,
    strided_feature_ids,
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
    """The engine is asked for the captured ids plus L (pre-norm final), ascending, once."""
    assert vllm_aux_ids([1, 9, 17], 36) == (1, 9, 17, 36)
    assert vllm_aux_ids([9, 36], 36) == (9, 36)


def test_last_layer_is_a_portable_feature() -> None:
    """Feature id L-1 (HF index L, the last layer's raw output) is captured; V4-Flash's ids pass."""
    assert check_feature_ids([40, 41, 42], 43) == (40, 41, 42)
    assert check_hf_ids([41, 42, 43], 43) == (41, 42, 43)
    assert feature_to_hf(check_feature_ids([40, 41, 42], 43)) == (41, 42, 43)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([], "empty"),
        ([0, 36], r"outside \[0, 35\]"),
        ([-1, 3], "outside"),
        ([3, 3], "strictly increasing"),
        ([5, 2], "strictly increasing"),
    ],
)
def test_bad_feature_ids_are_rejected(ids, match) -> None:
    """Feature ids must be non-empty, strictly increasing and in [0, L-1]."""
    with pytest.raises(LayerIdError, match=match):
        check_feature_ids(ids, 36)


def test_bad_hf_ids_name_the_hf_range() -> None:
    """Captured HF indices outside [1, L] are rejected with the HF range in the message."""
    with pytest.raises(LayerIdError, match=r"allowed \[1, 36\]"):
        check_hf_ids([0, 4], 36)
    with pytest.raises(LayerIdError, match="outside"):
        check_hf_ids([37], 36)


def test_feature_positions_index_the_captured_layers() -> None:
    """Feature id l sits where HF index l + 1 was captured; missing ids are named."""
    held = (1, 5, 9, 13)
    assert feature_positions(held, (4, 12)) == (1, 3)
    assert feature_positions(held, (0, 4, 8, 12)) == (0, 1, 2, 3)
    assert missing_features(held, (0, 3, 8, 9)) == (3, 9)
    with pytest.raises(LayerIdError, match=r"feature ids \[3, 9\] \(HF indices \[4, 10\]\)"):
        feature_positions(held, (0, 3, 8, 9))


@pytest.mark.parametrize(("num_layers", "stride", "start", "expected"), [
    (36, 8, 1, (1, 9, 17, 25, 33)), (36, 16, 1, (1, 17, 33)), (36, 11, 1, (1, 12, 23, 34)),
    (4, 1, 0, (0, 1, 2)), (4, 2, 0, (0, 2)), (4, 1, 1, (1, 2)), (8, 3, 2, (2, 5))])
def test_stride_rule_takes_every_kth_portable_id(num_layers: int, stride: int, start: int,
                                                 expected: tuple[int, ...]) -> None:
    """layer_stride k: start, start + k, ... up to L - 2 (the last id every engine serves)."""
    ids = strided_feature_ids(num_layers, stride, start=start)
    assert ids == expected
    assert ids == tuple(i for i in range(num_layers - 1)
                        if i >= start and (i - start) % stride == 0)


def test_stride_rule_covers_the_default_draft_ids() -> None:
    """Strides dividing the default spacing hold the default ids (one cache, many drafts)."""
    default = default_feature_ids(36, 5)
    for stride in (1, 2, 4, 8):
        assert set(default) <= set(strided_feature_ids(36, stride))


@pytest.mark.parametrize(("stride", "start", "match"), [
    (0, 1, "layer_stride must be >= 1, got 0"), (1, 3, "must be non-empty"),
    (1, -1, r"ids \[-1\] are outside \[0, 3\]")])
def test_stride_rule_refuses_bad_input(stride: int, start: int, match: str) -> None:
    """A stride < 1 or a start outside the portable range is refused by the one range rule."""
    with pytest.raises(LayerIdError, match=match):
        strided_feature_ids(4, stride, start=start)
