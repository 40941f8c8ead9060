"""The seed-t interval and the bootstrap over seeds and prompts (their coverage checked by
simulation), paired differences and verdicts."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
from numpy.polynomial.hermite_e import hermegauss

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


def test_student_t_quantile_matches_closed_forms_and_tables():
    """Known truths: df 1 (Cauchy) and 2 have closed forms; df 3 and 10 are the printed
    table values; a large df is the normal."""
    for q in (0.6, 0.975, 0.9995):
        assert stats.student_t_quantile(q, 1) == pytest.approx(math.tan(math.pi * (q - 0.5)),
                                                               rel=1e-10)
        assert stats.student_t_quantile(q, 2) == pytest.approx(
            (2 * q - 1) / math.sqrt(2 * q * (1 - q)), rel=1e-10)
    assert stats.student_t_quantile(0.975, 3) == pytest.approx(3.182446305, abs=1e-8)
    assert stats.student_t_quantile(0.975, 10) == pytest.approx(2.228138852, abs=1e-8)
    assert stats.student_t_quantile(0.975, 1e7) == pytest.approx(
        NormalDist().inv_cdf(0.975), abs=1e-6)
    for q, df in ((0.4, 3), (0.975, 0)):
        with pytest.raises(ValueError):
            stats.student_t_quantile(q, df)


def test_incomplete_beta_matches_the_binomial_sum():
    """For integer a, b: I_x(a, b) = P(Binomial(a + b - 1, x) >= a)."""
    for a, b, x in ((1, 1, 0.3), (2, 5, 0.1), (7, 3, 0.8), (20, 40, 0.35), (3, 9, 0.99)):
        n = a + b - 1
        slow = sum(math.comb(n, j) * x**j * (1 - x) ** (n - j) for j in range(a, n + 1))
        assert stats._betainc(a, b, x) == pytest.approx(slow, rel=1e-10, abs=1e-14)


def _slow_seed_t(matrix: list[list[float]], crossed: bool) -> tuple[float, float, float]:
    """The interval of ``stats.seed_t`` by plain loops: the mean squares of a two-way
    analysis of variance summed element by element, each part of the variance scaled by
    its own t quantile."""
    n_seeds, n_prompts = len(matrix), len(matrix[0])
    cells = [x for row in matrix for x in row]
    grand = sum(cells) / len(cells)
    t_seeds = stats.student_t_quantile(0.975, n_seeds - 1) if n_seeds > 1 else 0.0
    t_prompts = stats.student_t_quantile(0.975, n_prompts - 1)
    if n_seeds == 1:
        seed_part = 0.0
        prompt_part = sum((x - grand) ** 2 for x in cells) / (n_prompts - 1) / n_prompts
    else:
        rows = [sum(row) / n_prompts for row in matrix]
        cols = [sum(row[p] for row in matrix) / n_seeds for p in range(n_prompts)]
        ms_seeds = n_prompts * sum((r - grand) ** 2 for r in rows) / (n_seeds - 1)
        ms_prompts = n_seeds * sum((c - grand) ** 2 for c in cols) / (n_prompts - 1)
        ms_resid = sum((matrix[s][p] - rows[s] - cols[p] + grand) ** 2
                       for s in range(n_seeds) for p in range(n_prompts)) / (
            (n_seeds - 1) * (n_prompts - 1))
        seed_part = ms_seeds / (n_seeds * n_prompts)
        prompt_part = max(ms_prompts - ms_resid, 0.0) / (n_seeds * n_prompts) if crossed else 0
    half = math.sqrt(t_seeds**2 * seed_part + t_prompts**2 * prompt_part)
    return grand, grand - half, grand + half


@pytest.mark.parametrize(("shape", "crossed"), [((3, 40), True), ((5, 25), True),
                                                ((3, 40), False), ((1, 30), True)])
def test_seed_t_matches_a_plain_loop(shape, crossed):
    rng = np.random.default_rng(8)
    # a seed effect and a prompt effect, so both parts of the variance are non-zero
    p = 0.2 + 0.3 * rng.random(shape[1])[None, :] + 0.2 * rng.random(shape[0])[:, None]
    matrix = (rng.random(shape) < p).astype(float) - (rng.random(shape) < 0.3)
    est = stats.seed_t(matrix, crossed)
    assert (est.mean, est.lo, est.hi) == pytest.approx(
        _slow_seed_t(matrix.tolist(), crossed), abs=1e-12)
    assert (est.seeds, est.prompts, est.crossed) == (*shape, crossed)


def test_seed_t_of_a_batch_is_each_matrix_s_interval():
    matrices = (np.random.default_rng(4).random((6, 3, 20)) < 0.4).astype(float)
    mean, lo, hi = stats.seed_t_bounds(matrices)
    for i, m in enumerate(matrices):
        est = stats.seed_t(m)
        assert (mean[i], lo[i], hi[i]) == pytest.approx((est.mean, est.lo, est.hi), abs=1e-12)


def test_prompt_effects_shared_by_every_seed_widen_the_interval():
    """The same per-prompt differences at every seed (greedy scores of the untrained
    model): the seeds agree exactly, yet the gap depends on which prompts were drawn, and
    the interval is the t interval over those prompts."""
    row = (np.random.default_rng(6).random(50) < 0.3).astype(float)
    est = stats.seed_t(np.tile(row, (3, 1)))
    assert est.lo < est.mean < est.hi
    assert est.hi - est.mean == pytest.approx(
        stats.student_t_quantile(0.975, 49) * row.std(ddof=1) / math.sqrt(50))
    single = stats.seed_t([row])  # one seed: the prompts only, the same interval
    assert (est.lo, est.hi) == pytest.approx((single.lo, single.hi), abs=1e-12)
    with pytest.raises(ValueError, match="no spread"):
        stats.seed_t([[1.0]])


def _simulated_grids(n_seeds: int, seed_sd: float, grids: int = 2000, prompts: int = 300,
                     seed: int = 0) -> tuple[np.ndarray, float]:
    """``grids`` paired comparisons of two cells, as grids x seeds x prompts differences
    of 0/1 outcomes, and the true difference of the two cells' expected accuracies.

    A prompt is right with probability sigmoid(cell + prompt + cell's prompt effect +
    cell's seed effect), all effects normal on the logit scale: the prompt's difficulty
    (SD 2, shared by both cells) and the cell's own per-prompt effect (SD 1) give the
    per-prompt spread of the committed tiny3 runs (an accuracy near 40%, prompts right in
    every run or in none); ``seed_sd`` 0.8 gives the seed-to-seed spread of about 10
    points of their bf16 and hif4+resq-2:4 cells. The truth is the expectation over
    prompts and seeds, E sigmoid(cell + Z) with Z ~ N(0, 2^2 + 1 + seed_sd^2), by
    Gauss-Hermite quadrature."""
    rng = np.random.default_rng(seed)
    cell = np.array([-0.4, -0.7])  # a gap of about 5 points
    logits = (cell[None, :, None, None] + rng.normal(0, 2.0, (grids, 1, 1, prompts))
              + rng.normal(0, 1.0, (grids, 2, 1, prompts))
              + rng.normal(0, seed_sd, (grids, 2, n_seeds, 1)))
    right = rng.random(logits.shape) < 1 / (1 + np.exp(-logits))
    nodes, weights = hermegauss(80)
    spread = math.sqrt(4.0 + 1.0 + seed_sd**2)
    expected = [float(weights @ (1 / (1 + np.exp(-(c + spread * nodes))))) / weights.sum()
                for c in cell]
    return right[:, 0].astype(float) - right[:, 1], expected[0] - expected[1]


@pytest.mark.parametrize("n_seeds", [3, 5])
def test_the_interval_covers_a_known_difference_and_the_bootstrap_does_not(n_seeds):
    """2,000 simulated grids the size of tiny3 (300 prompts, seed-to-seed SD of a cell's
    accuracy about 10 points): the seed-t interval covers the true difference 93-97% of the
    time; the two-way bootstrap, with the same data, clearly less often."""
    diffs, truth = _simulated_grids(n_seeds, seed_sd=0.8)
    seed_sd = 100 * diffs.mean(axis=2).std(axis=1, ddof=1).mean() / math.sqrt(2)
    assert 8 < seed_sd < 13  # the spread of one cell, in points
    _, lo, hi = stats.seed_t_bounds(diffs)
    covered = np.mean((lo <= truth) & (truth <= hi))
    assert 0.93 <= covered <= 0.97
    booted = [stats.bootstrap(d, resamples=500) for d in diffs]
    boot_covered = np.mean([e.lo <= truth <= e.hi for e in booted])
    assert boot_covered < 0.90 and boot_covered < covered - 0.05


@pytest.mark.parametrize("n_seeds", [3, 5])
def test_without_the_prompt_part_seeds_that_barely_differ_undercover(n_seeds):
    """When seeds barely differ (SD about 2 points), the prompts all seeds share are most
    of the uncertainty: a t interval over the per-seed means alone misses the truth too
    often; with the prompt part it does not."""
    diffs, truth = _simulated_grids(n_seeds, seed_sd=0.1, seed=1)
    _, lo, hi = stats.seed_t_bounds(diffs)
    covered = np.mean((lo <= truth) & (truth <= hi))
    per_seed = diffs.mean(axis=2)
    half = stats.student_t_quantile(0.975, n_seeds - 1) * per_seed.std(
        axis=1, ddof=1) / math.sqrt(n_seeds)
    seeds_only = np.mean(np.abs(per_seed.mean(axis=1) - truth) <= half)
    assert 0.93 <= covered <= 0.97 and seeds_only < 0.94


def test_paired_difference_pairs_only_the_seeds_both_cells_have():
    rng = np.random.default_rng(9)
    five = [Outcomes(s, tuple((rng.random(30) < 0.6).astype(float)), "p") for s in range(5)]
    three = [Outcomes(s, tuple((rng.random(30) < 0.3).astype(float)), "p") for s in (0, 2, 4)]
    diff = paired_difference(five, three)
    common = np.array([np.subtract(five[s].scores, three[i].scores)
                       for i, s in enumerate((0, 2, 4))])
    assert diff.seeds == 3 and diff == stats.seed_t(common)
    boot = paired_difference(five, three, stats.bootstrap)
    assert boot != diff and boot.mean == diff.mean and boot.seeds == 3
