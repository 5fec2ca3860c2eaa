"""Confidence calibration metrics and verification policies against brute-force references."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sparkforge.trainer.eval.calibration import (
    auroc,
    brier_score,
    expected_calibration_error,
    policy_table,
)


def test_auroc_equals_pairwise_count_with_ties() -> None:
    """AUROC is the share of (accepted, rejected) pairs ranked right, ties counting 1/2."""
    rng = np.random.default_rng(0)
    conf = rng.integers(0, 6, size=60) / 5.0   # many ties
    acc = rng.random(60) < conf
    pairs = [(a, b) for a, b in itertools.product(conf[acc], conf[~acc])]
    expected = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) / len(pairs)
    assert auroc(conf, acc) == pytest.approx(expected, abs=1e-12)
    assert auroc([0.2, 0.9], [False, True]) == 1.0
    assert auroc([0.5, 0.6], [True, True]) is None


def test_ece_and_brier_by_hand() -> None:
    """Two bins: |0.15-0.5| and |0.85-1|, weighted 2/4 each; Brier is the mean squared gap."""
    conf, out = [0.12, 0.18, 0.82, 0.88], [0.0, 1.0, 1.0, 1.0]
    assert expected_calibration_error(conf, out) == pytest.approx(0.5 * 0.35 + 0.5 * 0.15)
    assert brier_score(conf, out) == pytest.approx((0.0144 + 0.6724 + 0.0324 + 0.0144) / 4)
    assert expected_calibration_error([], []) == 0.0


def _expected_tokens(accept: np.ndarray, m: int) -> float:
    """1 + sum over accepted-prefix lengths n of P(exactly n) * n, by enumeration."""
    total, reach = 1.0, 1.0
    for k in range(m):
        reach *= accept[k]
        total += reach
    return total


def test_policy_table_matches_enumeration() -> None:
    """Fixed lengths and thresholds give the brute-force expected tokens and verified slots."""
    rng = np.random.default_rng(1)
    accept = rng.random((50, 5))
    conf = rng.random((50, 5))
    valid = np.arange(5)[None, :] < rng.integers(1, 6, size=50)[:, None]
    table = {r["policy"]: r for r in policy_table(accept, conf, valid, [0.3, 0.7])}
    for length in range(1, 6):
        m = np.minimum(valid.sum(1), length)
        ref = np.mean([_expected_tokens(accept[i], m[i]) for i in range(50)])
        assert table[f"fixed {length}"]["tokens_per_round"] == pytest.approx(ref)
        assert table[f"fixed {length}"]["verified_slots"] == pytest.approx(m.mean())
    for t in (0.3, 0.7):
        m = np.array([next((k for k in range(5) if conf[i, k] < t or not valid[i, k]), 5)
                      for i in range(50)])
        ref = np.mean([_expected_tokens(accept[i], m[i]) for i in range(50)])
        row = table[f"confidence >= {t:g}"]
        assert row["tokens_per_round"] == pytest.approx(ref)
        assert row["verified_slots"] == pytest.approx(m.mean())
        assert row["accepted_per_verified"] == pytest.approx((ref - 1) / m.mean())


def test_policy_table_without_confidence_has_only_fixed_lengths() -> None:
    """A draft without a confidence head gets the fixed-length rows only."""
    rows = policy_table(np.full((3, 2), 0.5), None, np.ones((3, 2), dtype=bool), [0.5])
    assert [r["policy"] for r in rows] == ["fixed 1", "fixed 2"]
    assert rows[1]["tokens_per_round"] == pytest.approx(1.75)
