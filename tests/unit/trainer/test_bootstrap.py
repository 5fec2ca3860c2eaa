"""Bootstrap intervals of a ratio over clusters, against an exact enumeration and a normal mean."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sparkforge.trainer.eval.bootstrap import agreement, half_width, ratio_ci


def _exact_quantile(num: np.ndarray, den: np.ndarray, q: float) -> float:
    """The q-quantile of the exact bootstrap distribution: every one of the n**n resamples."""
    n = num.size
    ratios = np.sort([num[list(c)].sum() / den[list(c)].sum()
                      for c in itertools.product(range(n), repeat=n)])
    return float(ratios[int(np.ceil(q * ratios.size)) - 1])


def test_interval_is_the_exact_bootstrap_distributions_quantiles() -> None:
    """With 4 clusters all 256 resamples can be listed by hand: the Monte Carlo interval lands
    on the same atoms of that distribution (neither quantile is near a jump)."""
    num, den = np.array([0.0, 1.0, 2.0, 7.0]), np.array([1.0, 2.0, 1.0, 3.0])
    lo, hi = ratio_ci(num, den, resamples=200_000, seed=3)
    assert lo == pytest.approx(_exact_quantile(num, den, 0.025))
    assert hi == pytest.approx(_exact_quantile(num, den, 0.975))
    assert (lo, hi) == pytest.approx((1 / 3, 2.25))


def test_interval_of_a_normal_mean_matches_the_textbook_one_and_covers() -> None:
    """Unit denominators make the ratio a mean: its interval is mean +- 1.96 s/sqrt(n), and over
    repeated samples it covers the true mean about 95% of the time."""
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 1.0, size=400)
    lo, hi = ratio_ci(x, np.ones_like(x), seed=1)
    expected = 1.96 * x.std(ddof=1) / np.sqrt(x.size)
    assert half_width((lo, hi)) == pytest.approx(expected, rel=0.1)
    assert (lo + hi) / 2 == pytest.approx(x.mean(), abs=0.02)
    covered = 0
    for i in range(200):
        s = rng.normal(3.0, 1.0, size=50)
        a, b = ratio_ci(s, np.ones_like(s), resamples=1000, seed=i)
        covered += a <= 3.0 <= b
    assert 0.88 <= covered / 200 <= 0.99


def test_one_cluster_gives_a_point_and_bad_input_is_named() -> None:
    """A single prompt has no spread to resample; empty or ragged input is refused."""
    assert ratio_ci([5.0], [2.0]) == (2.5, 2.5)
    with pytest.raises(ValueError, match="non-empty"):
        ratio_ci([], [])
    with pytest.raises(ValueError, match="shapes"):
        ratio_ci([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="level=1.5"):
        ratio_ci([1.0], [1.0], level=1.5)


def test_agreement_combines_the_two_intervals_by_hand() -> None:
    """Half-widths 0.2 and 0.1 give a difference interval of +-sqrt(0.2**2 + 0.1**2)."""
    near = agreement(3.0, (2.8, 3.2), 3.1, (3.0, 3.2))
    assert near["difference"] == pytest.approx(-0.1)
    assert near["difference_ci95"] == pytest.approx([-0.1 - 0.05 ** 0.5, -0.1 + 0.05 ** 0.5])
    assert near["agree"] is True
    far = agreement(3.0, (2.8, 3.2), 3.5, (3.4, 3.6))
    assert far["agree"] is False
