"""Percentile bootstrap intervals of a ratio of sums over independent clusters (e.g. prompts).

Tau is tokens over rounds summed over prompts; rounds of one prompt are not independent (they
share its text), so the prompt is the unit resampled: each resample draws ``n`` prompts with
replacement and recomputes ``sum(numerator) / sum(denominator)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

LEVEL = 0.95
RESAMPLES = 4000


def ratio_ci(numerators: Sequence[float] | np.ndarray, denominators: Sequence[float] | np.ndarray,
             *, level: float = LEVEL, resamples: int = RESAMPLES,
             seed: int = 0) -> tuple[float, float]:
    """The ``level`` percentile interval of ``sum(num) / sum(den)`` over resampled clusters.

    Resamples whose denominators sum to zero are dropped. One cluster gives a zero-width interval.

    Raises:
        ValueError: No clusters, mismatched lengths or a level outside (0, 1).
    """
    num, den = np.asarray(numerators, dtype=np.float64), np.asarray(denominators, dtype=np.float64)
    if num.shape != den.shape or num.ndim != 1 or num.size == 0:
        raise ValueError(f"ratio_ci needs equal, non-empty 1-D numerators and denominators, got "
                         f"shapes {num.shape} and {den.shape}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"ratio_ci level={level}: expected a value in (0, 1)")
    picks = np.random.default_rng(seed).integers(0, num.size, size=(resamples, num.size))
    totals = den[picks].sum(axis=1)
    keep = totals > 0
    ratios = num[picks].sum(axis=1)[keep] / totals[keep]
    if ratios.size == 0:
        return 0.0, 0.0
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(ratios, [tail, 1.0 - tail])
    return float(lo), float(hi)


def half_width(interval: Sequence[float]) -> float:
    """Half the width of an interval."""
    return (interval[1] - interval[0]) / 2.0


def agreement(a: float, a_ci: Sequence[float], b: float,
              b_ci: Sequence[float]) -> dict[str, float | bool | list[float]]:
    """Whether two independent estimates agree: the 95% interval of ``a - b`` holds 0.

    Each interval's half-width gives its standard error (normal approximation); the difference's
    standard error is the root of their summed squares.
    """
    z = NormalDist().inv_cdf(0.5 + LEVEL / 2.0)
    se = float(np.hypot(half_width(a_ci), half_width(b_ci))) / z
    diff = a - b
    ci = [diff - z * se, diff + z * se]
    return {"difference": diff, "difference_ci95": ci, "agree": ci[0] <= 0.0 <= ci[1]}
