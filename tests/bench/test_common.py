"""The bench's ratio: the median of repeat-by-repeat ratios, with its sign-test interval."""

from __future__ import annotations

import math
import random

import pytest

from fp4rl.bench.common import Comparison, compare, measure, median_interval, paired_ratio


def _coverage(n: int, k: int) -> float:
    """P(x_(k) <= median <= x_(n+1-k)), counted from the binomial directly."""
    return sum(math.comb(n, j) for j in range(k, n - k + 1)) / 2 ** n


@pytest.mark.parametrize("n", [5, 7, 9, 12, 20, 31])
def test_the_interval_is_the_narrowest_with_the_coverage_asked(n):
    xs = [float(i) for i in random.Random(n).sample(range(1000), n)]
    (lo, hi), cover = median_interval(xs, least=0.90)
    ordered = sorted(xs)
    k = ordered.index(lo) + 1
    assert hi == ordered[n - k]
    assert cover == pytest.approx(_coverage(n, k))
    assert cover >= 0.90 and _coverage(n, k + 1) < 0.90  # one step narrower falls short


def test_too_few_values_give_no_interval():
    assert median_interval([1.0, 2.0, 3.0, 4.0], least=0.90) is None  # 87.5% at best
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0], least=0.90) == ((1.0, 5.0), 0.9375)


def test_a_baseline_that_drifts_cancels_in_the_paired_ratio():
    # the baseline's machine halves its speed after three repeats; the candidate is
    # always 1.2x the baseline of its own repeat
    base = [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    cand = [1.2 * b for b in base]
    ratio, interval, cover = paired_ratio(cand, base)
    assert ratio == pytest.approx(1.2) and interval == pytest.approx((1.2, 1.2))
    assert cover == pytest.approx(1 - 2 / 2 ** 7)
    # repeats whose candidate met the slow phase and baseline the fast one, or the other way
    # round, are outliers of the ratio, not its median
    base = [1.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0]
    cand = [1.2, 2.4, 2.4, 1.2, 1.2, 1.2, 2.4]
    assert paired_ratio(cand, base)[0] == pytest.approx(1.2)


def test_unpaired_sides_fall_back_to_the_ratio_of_medians():
    ratio, interval, cover = paired_ratio([3.0], [2.0, 2.0])
    assert ratio == 1.5 and interval is None and cover is None


def test_compare_and_shown():
    t = measure({"a": lambda: None, "b": lambda: None}, repeats=6, warmup=0)
    row = compare("x", t, "a", "b")
    assert isinstance(row, Comparison) and row.interval is not None
    assert row.shown().startswith(f"{row.ratio:.2f}x (")
    assert Comparison("x", "a", "b", [1.0], [1.0], 1.0).shown() == "1.00x"
