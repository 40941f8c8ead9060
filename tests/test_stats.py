"""The bootstrap over seeds and prompts, paired differences and verdicts."""

from __future__ import annotations

import numpy as np
import pytest

from fp4rl.experiments import stats
from fp4rl.experiments.stats import Outcomes, bootstrap, paired_difference, verdict


def _slow_bootstrap(matrix: list[list[float]], crossed: bool, resamples: int, seed: int,
                    level: float = 0.95) -> tuple[float, float, float]:
    """The same resampling written as plain loops: the generator is asked for the same
    draws in the same order (stats' docstring), every mean is summed element by element,
    and the percentiles are numpy's default linear interpolation, done by hand."""
    rng = np.random.default_rng(seed)
    n_seeds, n_prompts = len(matrix), len(matrix[0])
    seed_draws = rng.integers(0, n_seeds, size=(resamples, n_seeds)).tolist()
    shape = (resamples, n_prompts) if crossed else (resamples, n_seeds, n_prompts)
    prompt_draws = rng.integers(0, n_prompts, size=shape).tolist()
    means = []
    for b in range(resamples):
        total = 0.0
        for i, s in enumerate(seed_draws[b]):
            for p in prompt_draws[b] if crossed else prompt_draws[b][i]:
                total += matrix[s][p]
        means.append(total / (n_seeds * n_prompts))
    means.sort()

    def quantile(q: float) -> float:
        position = q * (len(means) - 1)
        low = int(position)
        high = min(low + 1, len(means) - 1)
        return means[low] + (means[high] - means[low]) * (position - low)

    tail = (1 - level) / 2
    overall = sum(sum(row) for row in matrix) / (n_seeds * n_prompts)
    return overall, quantile(tail), quantile(1 - tail)


@pytest.mark.parametrize("crossed", [True, False])
def test_bootstrap_matches_a_plain_loop_with_the_same_draws(crossed):
    rng = np.random.default_rng(5)
    matrix = (rng.random((3, 40)) < 0.4).astype(float).tolist()
    fast = bootstrap(matrix, crossed=crossed, resamples=300, seed=11)
    assert (fast.mean, fast.lo, fast.hi) == pytest.approx(
        _slow_bootstrap(matrix, crossed, 300, 11), abs=1e-12)
    assert (fast.seeds, fast.prompts, fast.crossed) == (3, 40, crossed)
    assert fast.lo < fast.mean < fast.hi


def test_bootstrap_is_reproducible_and_its_generator_seed_matters():
    matrix = (np.arange(3 * 50).reshape(3, 50) % 3 == 0).astype(float)
    assert bootstrap(matrix) == bootstrap(matrix)
    assert bootstrap(matrix, seed=1) != bootstrap(matrix, seed=2)


def test_nested_chunks_cover_every_resample():
    """More resamples than one chunk: the chunked gather must equal one big gather."""
    matrix = (np.random.default_rng(3).random((2, 30)) < 0.5).astype(float).tolist()
    n = stats._CHUNK * 2 + 7
    assert bootstrap(matrix, crossed=False, resamples=n, seed=4).hi == pytest.approx(
        _slow_bootstrap(matrix, False, n, 4)[2], abs=1e-12)


def test_bootstrap_refuses_an_empty_matrix():
    with pytest.raises(ValueError, match="seeds x prompts"):
        bootstrap(np.zeros((0, 4)))
    with pytest.raises(ValueError, match="seeds x prompts"):
        bootstrap([1.0, 0.0])


def _runs(rows: list[list[int]], prompts: str = "p") -> list[Outcomes]:
    return [Outcomes(seed, tuple(float(x) for x in row), prompts)
            for seed, row in enumerate(rows)]


def test_identical_cells_are_within_noise():
    rows = (np.random.default_rng(0).random((3, 60)) < 0.3).astype(int).tolist()
    diff = paired_difference(_runs(rows), _runs(rows))
    assert (diff.mean, diff.lo, diff.hi) == (0.0, 0.0, 0.0)
    assert verdict(diff) == "within noise"


def test_always_right_against_always_wrong_holds_and_the_reverse_is_reversed():
    right, wrong = _runs([[1] * 50] * 3), _runs([[0] * 50] * 3)
    assert verdict(paired_difference(right, wrong)) == "holds"
    assert verdict(paired_difference(wrong, right)) == "reversed"
    assert paired_difference(right, wrong).lo == 1.0


def test_pairing_separates_a_gap_that_two_means_cannot():
    """B is A with a tenth of A's right answers turned wrong: both accuracies' intervals
    overlap, yet prompt by prompt A is never below B, so the paired gap excludes 0."""
    rng = np.random.default_rng(1)
    a = (rng.random((3, 300)) < 0.5).astype(int)
    b = a.copy()
    b[:, ::10] = 0
    est_a, est_b = stats.accuracy(_runs(a.tolist())), stats.accuracy(_runs(b.tolist()))
    assert est_b.hi > est_a.lo  # the unpaired intervals overlap
    diff = paired_difference(_runs(a.tolist()), _runs(b.tolist()))
    assert diff.lo > 0 and verdict(diff) == "holds"


def test_a_noisy_small_gap_is_within_noise():
    rng = np.random.default_rng(2)
    a = (rng.random((3, 100)) < 0.5).astype(int).tolist()
    b = (rng.random((3, 100)) < 0.5).astype(int).tolist()
    diff = paired_difference(_runs(a), _runs(b))
    assert diff.lo < 0 < diff.hi and verdict(diff) == "within noise"


def test_paired_difference_uses_common_seeds_and_refuses_other_prompts():
    a = [Outcomes(0, (1.0, 1.0), "p"), Outcomes(2, (1.0, 0.0), "p")]
    b = [Outcomes(0, (0.0, 1.0), "p"), Outcomes(1, (0.0, 0.0), "p")]
    diff = paired_difference(a, b)
    assert (diff.seeds, diff.prompts, diff.mean) == (1, 2, 0.5)
    assert paired_difference(a, [Outcomes(1, (0.0, 0.0), "p")]) == (
        "no seed finished in both cells")
    assert paired_difference(a, [Outcomes(0, (0.0, 1.0), "q")]) == (
        "the two cells were scored on different prompts")


def test_seeds_with_prompts_of_their_own_are_resampled_within_each_seed():
    same = stats.accuracy([Outcomes(0, (1.0, 0.0), "p"), Outcomes(1, (0.0, 1.0), "p")])
    own = stats.accuracy([Outcomes(0, (1.0, 0.0), "p"), Outcomes(1, (0.0, 1.0), "q")])
    assert same.crossed and not own.crossed
    assert stats.accuracy([Outcomes(0, (1.0,), "p"), Outcomes(1, (1.0, 0.0), "q")]) == (
        "seeds were scored on different numbers of prompts")
    assert stats.accuracy([]) == "no finished seed"


def test_scaled_estimate_keeps_its_design():
    est = stats.Estimate(0.5, 0.25, 0.75, 3, 10, True).scaled(100)
    assert est == stats.Estimate(50.0, 25.0, 75.0, 3, 10, True)


def test_difference_of_means_matches_a_plain_loop_with_the_same_draws():
    a, b = [0.1, 0.4, 0.3, 0.6, 0.2], [0.0, 0.1, 0.05]
    rng = np.random.default_rng(7)
    draws_a = rng.integers(0, len(a), size=(500, len(a)))
    draws_b = rng.integers(0, len(b), size=(500, len(b)))
    slow = [sum(a[i] for i in ra) / len(a) - sum(b[i] for i in rb) / len(b)
            for ra, rb in zip(draws_a, draws_b, strict=True)]
    est = stats.difference_of_means(a, b, resamples=500, seed=7)
    assert est.mean == pytest.approx(np.mean(a) - np.mean(b))
    assert (est.lo, est.hi) == pytest.approx(tuple(np.percentile(slow, [2.5, 97.5])))
    assert verdict(stats.difference_of_means([1.0] * 6, [0.0] * 6)) == "holds"
    with pytest.raises(ValueError):
        stats.difference_of_means([], b)
