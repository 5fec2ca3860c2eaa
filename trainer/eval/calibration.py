"""How well the confidence head predicts acceptance: ECE, Brier score, AUROC, threshold policies.

``confidence`` is the head's sigmoid output per draft slot; ``outcome`` is what happened there:
the analytic acceptance probability (teacher-forced, soft) or a 0/1 accept event (measured in
speculative decoding).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from sparkforge.trainer.eval.report import reliability_bins


def expected_calibration_error(confidence: npt.ArrayLike, outcome: npt.ArrayLike, *,
                               num_bins: int = 10) -> float:
    """Equal-width-bin ECE: ``sum_b n_b/N * |mean confidence_b - mean outcome_b|``."""
    bins = reliability_bins(np.asarray(confidence, dtype=np.float64).tolist(),
                            np.asarray(outcome, dtype=np.float64).tolist(), num_bins=num_bins)
    total = sum(b["count"] for b in bins)
    return sum(b["count"] * abs(b["confidence"] - b["accept"]) for b in bins) / total if total \
        else 0.0


def brier_score(confidence: npt.ArrayLike, outcome: npt.ArrayLike) -> float:
    """Mean squared difference between confidence and outcome."""
    c, y = np.asarray(confidence, dtype=np.float64), np.asarray(outcome, dtype=np.float64)
    return float(np.mean((c - y) ** 2)) if c.size else 0.0


def auroc(confidence: npt.ArrayLike, accepted: npt.ArrayLike) -> float | None:
    """Probability that an accepted slot has a higher confidence than a rejected one (ties 1/2).

    None when only one class occurs. Computed from average ranks (Mann-Whitney U).
    """
    c = np.asarray(confidence, dtype=np.float64)
    y = np.asarray(accepted, dtype=bool)
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return None
    order = np.argsort(c, kind="mergesort")
    ranks = np.empty(c.size, dtype=np.float64)
    sorted_c = c[order]
    start = 0
    while start < c.size:  # average the ranks of ties
        end = start
        while end + 1 < c.size and sorted_c[end + 1] == sorted_c[start]:
            end += 1
        ranks[order[start:end + 1]] = (start + end) / 2 + 1
        start = end + 1
    u = ranks[y].sum() - pos * (pos + 1) / 2
    return float(u / (pos * neg))


def policy_table(accept_NK: np.ndarray, confidence_NK: np.ndarray | None, valid_NK: np.ndarray,
                 thresholds: Sequence[float]) -> list[dict[str, float | str]]:
    """Expected tokens per round and verified slots, for fixed lengths and confidence thresholds.

    Each of the N blocks has per-slot acceptance probabilities ``accept_NK`` (conditional on the
    earlier slots being accepted) and ``valid_NK`` (a contiguous prefix of slots that has data).
    A policy verifies the first ``m`` slots of a block; the round then yields
    ``1 + sum_{k<m} prod_{j<=k} accept_j`` tokens in expectation. Fixed policies use
    ``m = min(length, valid)``; a threshold ``t`` verifies the slots before the first one whose
    confidence is below ``t``.
    """
    n, k = accept_NK.shape
    valid_len = valid_NK.astype(bool).cumprod(axis=1).sum(axis=1)
    survive_NK = np.cumprod(np.where(valid_NK, accept_NK, 0.0), axis=1)
    rows: list[dict[str, float | str]] = []

    def _row(policy: str, m_N: np.ndarray) -> dict[str, float | str]:
        used = np.arange(k)[None, :] < m_N[:, None]
        tokens = 1.0 + (survive_NK * used).sum(axis=1)
        verified = float(m_N.mean()) if n else 0.0
        mean_tokens = float(tokens.mean()) if n else 0.0
        return {"policy": policy, "tokens_per_round": mean_tokens, "verified_slots": verified,
                "accepted_per_verified": (mean_tokens - 1.0) / verified if verified else 0.0}

    for length in range(1, k + 1):
        rows.append(_row(f"fixed {length}", np.minimum(valid_len, length)))
    if confidence_NK is not None:
        for t in thresholds:
            below = (confidence_NK < t) | ~valid_NK.astype(bool)
            first_below = np.where(below.any(axis=1), below.argmax(axis=1), k)
            rows.append(_row(f"confidence >= {t:g}", first_below))
    return rows
