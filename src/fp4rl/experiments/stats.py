"""Intervals over seeds and test prompts, paired comparisons and the verdict rule.

A GRPO cell's accuracy moves with the seed (data order, sampling) and with the test
prompts it is scored on; an interval that covers only one of the two (a binomial one
covers the prompts only) makes gaps look more certain than they are. Each cell at each
seed contributes one row of per-prompt accuracy (1 or 0 for greedy Mean@1, the share of
correct samples for Mean@k), so a cell, or the paired difference of two cells, is a
seeds x prompts matrix ``d[s, p]``.

**The interval every verdict uses** (:func:`seed_t`) reads that matrix as a crossed
random-effects model, ``d[s, p] = delta + a[p] + b[s] + e[s, p]``: ``b`` the seed's
effect (the run's luck), ``a`` the prompt's (an easy prompt; the same for every seed when
all seeds were scored on the same prompts, ``crossed``), ``e`` what is left. The mean of
the matrix has variance ``var(b) / S + var(a) / N + var(e) / (S N)``, which the two-way
analysis of variance estimates without bias as ``(MS_seeds + MS_prompts - MS_resid) /
(S N)``. Its two parts:

* ``MS_seeds / (S N)`` is the spread of the S per-seed means around their mean, over S:
  the variance of a Student-t interval over seeds (S - 1 degrees of freedom);
* ``(MS_prompts - MS_resid) / (S N)`` (kept at 0 or above) is ``var(a) / N``, the
  prompt-sampling variance of the seed-averaged mean: every seed shares the same prompts,
  so the spread over seeds cannot show it, and it widens the interval.

Each part is scaled by its own t quantile and the two are added in quadrature: the
half-width is ``sqrt(t(S - 1)^2 MS_seeds / (S N) + t(N - 1)^2 var(a) / N)``. This is
Banerjee's (1960) interval for a sum of independently estimated variances, which never
falls below its nominal level; it is the t interval over seeds where the seed part
dominates (the ``tiny3`` runs, where a cell's accuracy moves by about 10 points from seed
to seed) and a t interval over prompts where seeds barely differ (greedy scores of the
untrained model, the same at every seed). The simpler readings fail at one end: one
t(S - 1) quantile for the sum covers 99.5% with 3 seeds that barely differ (an interval
more than twice as wide as it needs to be), and Satterthwaite's degrees of freedom,
estimated from the same three noisy seed means, cover only 92-94%; this one covered
94-97% in every setting simulated (seed-to-seed spreads of 1 to 15 points, 3 and 5
seeds). When each seed was scored on prompts of its own (``nested``), the per-seed means
are independent and their spread already holds the prompt sampling: the interval is the
plain t over seeds. With one seed no seed spread can be measured: the interval covers
the prompts only (a t interval over the per-prompt values, N - 1 degrees of freedom),
which the report says. The simulation in ``tests/experiments/test_stats.py`` checks that 95%
intervals built this way cover a known difference 93-97% of the time, with 3 and with 5
seeds.

**The bootstrap** (:func:`bootstrap`, a secondary column in the report) resamples the
seeds and the prompts with replacement and takes percentiles of the resampled means:

* every resample draws the seeds with replacement and the test prompts with replacement,
  and takes the mean of the drawn rows at the drawn prompts;
* when every seed was scored on the same prompts (``crossed``), one draw of prompts is
  shared by all the drawn seeds, so a hard prompt stays hard across seeds; otherwise the
  prompts are drawn within each drawn seed (``nested``: each seed has prompts of its own);
* the interval is the 2.5th to 97.5th percentile of the resampled means.

With 3 or 5 seeds it is too narrow: resampling a handful of seeds understates their
spread (by a factor (S - 1) / S in variance) and its percentiles are those of a normal
rather than of a t with S - 1 degrees of freedom, so it covers a known difference well
below 95% of the time (the same simulation measures how far below).

A comparison is **paired**: the difference of two cells is taken prompt by prompt at
each seed both cells finished (the seeds they have in common, never unequal sets), and
either interval is applied to the differences, so what the two cells share (an easy
prompt, a lucky data order) cancels. The bootstrap's random draws come from a fixed
generator seed, so a report is reproducible number for number.

The bootstrap's draws, in order (a slow reimplementation can repeat them)::

    rng = numpy.random.default_rng(seed)
    seed_draws = rng.integers(0, S, size=(resamples, S))
    prompt_draws = rng.integers(0, N, size=(resamples, N))      # crossed
    prompt_draws = rng.integers(0, N, size=(resamples, S, N))   # nested
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

RESAMPLES = 4000
RNG_SEED = 20260
LEVEL = 0.95
VERDICTS = ("holds", "reversed", "within noise")
#: resamples per chunk of the nested bootstrap, which gathers resamples x S x N values
_CHUNK = 256


@dataclass(frozen=True)
class Estimate:
    """A mean (of accuracy, or of a paired difference) and its interval."""

    mean: float
    lo: float
    hi: float
    seeds: int
    prompts: int
    crossed: bool

    def scaled(self, factor: float) -> Estimate:
        """The same estimate in other units (e.g. x100 for percentage points)."""
        return Estimate(self.mean * factor, self.lo * factor, self.hi * factor, self.seeds,
                        self.prompts, self.crossed)


@dataclass(frozen=True)
class Outcomes:
    """One cell's per-prompt accuracy on one benchmark at one seed, in test-prompt order;
    ``prompts`` identifies the test prompts, so two runs are paired only on the same ones."""

    seed: int
    scores: tuple[float, ...]
    prompts: str


#: iteration cap of the continued fraction and of Newton's method; both stop as soon as
#: they have converged, the cap only bounds a pathological input
_MAX_TERMS = 300
_TINY = 1e-300


def _nonzero(x: float) -> float:
    return x if abs(x) >= _TINY else _TINY


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) by its continued fraction
    (modified Lentz), evaluated on the side of I_x(a, b) = 1 - I_(1-x)(b, a) where the
    fraction converges fast (numpy has no special functions)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):
        return 1 - _betainc(b, a, 1 - x)
    c, d = 1.0, 1 / _nonzero(1 - (a + b) * x / (a + 1))
    fraction = d
    for m in range(1, _MAX_TERMS):
        for term in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                     -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d, c = 1 / _nonzero(1 + term * d), _nonzero(1 + term / c)
            fraction *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
                     + b * math.log1p(-x))
    return front * fraction / a


def student_t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile (0.5 < q < 1) of Student's t with ``df`` > 0 degrees of freedom.
    Newton's method from 0 on the upper tail ``P(T > t) = I_(df / (df + t^2))(df / 2,
    1 / 2) / 2``: the tail is convex in t, so every step lands below the root and the
    iteration climbs to it without overshooting."""
    if not 0.5 < q < 1 or not df > 0:
        raise ValueError(f"student_t_quantile takes 0.5 < q < 1 and df > 0, got {q}, {df}")
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    t = 0.0
    for _ in range(_MAX_TERMS):
        tail = _betainc(df / 2, 0.5, df / (df + t * t)) / 2
        step = (tail - (1 - q)) / (scale * (1 + t * t / df) ** (-(df + 1) / 2))
        t += step
        if abs(step) <= 1e-12 * max(t, 1.0):
            break
    return t


def _variance_parts(values: np.ndarray, crossed: bool
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The mean of each seeds x prompts matrix in ``values`` (the last two axes; leading
    axes are independent matrices) and the two parts of its variance: the seed part
    (S - 1 degrees of freedom) and the prompt part (N - 1), module docstring."""
    n_seeds, n_prompts = values.shape[-2:]
    mean = values.mean(axis=(-2, -1))
    none = np.zeros_like(mean)
    if n_seeds == 1:  # no seed spread to measure: the prompts only
        return mean, none, values.var(axis=(-2, -1), ddof=1) / n_prompts
    seed_means = values.mean(axis=-1)
    seed_part = seed_means.var(axis=-1, ddof=1) / n_seeds  # MS_seeds / (S N)
    if not crossed or n_prompts == 1:  # the per-seed means are all there is
        return mean, seed_part, none
    prompt_means = values.mean(axis=-2)
    ms_prompts = n_seeds * prompt_means.var(axis=-1, ddof=1)
    resid = values - seed_means[..., None] - prompt_means[..., None, :] + mean[..., None, None]
    ms_resid = (resid**2).sum(axis=(-2, -1)) / ((n_seeds - 1) * (n_prompts - 1))
    return mean, seed_part, np.maximum(ms_prompts - ms_resid, 0) / (n_seeds * n_prompts)


def seed_t_bounds(values: np.ndarray, crossed: bool = True, level: float = LEVEL
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean, lower and upper bound of :func:`seed_t` for every seeds x prompts matrix in
    ``values`` at once (leading axes: a batch of matrices)."""
    values = np.asarray(values, dtype=np.float64)
    n_seeds, n_prompts = values.shape[-2:]
    mean, seed_part, prompt_part = _variance_parts(values, crossed)
    q = (1 + level) / 2
    t_seeds = student_t_quantile(q, n_seeds - 1) if n_seeds > 1 else 0.0
    t_prompts = student_t_quantile(q, n_prompts - 1) if n_prompts > 1 else 0.0
    half = np.sqrt(t_seeds**2 * seed_part + t_prompts**2 * prompt_part)
    return mean, mean - half, mean + half


def seed_t(outcomes: np.ndarray | Sequence[Sequence[float]], crossed: bool = True,
           level: float = LEVEL) -> Estimate:
    """The mean of a seeds x prompts matrix and its interval: Student's t over the seeds,
    widened by the prompt-sampling variance the seeds share (module docstring)."""
    values = _matrix(outcomes)
    if values.size == 1:
        raise ValueError("one seed scored on one prompt has no spread to estimate")
    mean, lo, hi = seed_t_bounds(values, crossed, level)
    return Estimate(float(mean), float(lo), float(hi), values.shape[0], values.shape[1],
                    crossed)


def _matrix(outcomes: np.ndarray | Sequence[Sequence[float] | np.ndarray]) -> np.ndarray:
    values = np.asarray(outcomes, dtype=np.float64)
    if values.ndim != 2 or 0 in values.shape:
        raise ValueError(f"outcomes must be a non-empty seeds x prompts matrix, got shape "
                         f"{values.shape}")
    return values


def _counts(draws: np.ndarray, size: int) -> np.ndarray:
    """How often each of ``size`` indices occurs in each row of ``draws``."""
    rows = draws.shape[0]
    flat = (draws + size * np.arange(rows)[:, None]).ravel()
    return np.bincount(flat, minlength=rows * size).reshape(rows, size).astype(np.float64)


@lru_cache(maxsize=4)
def _draws(n_seeds: int, n_prompts: int, crossed: bool, resamples: int,
           seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The resampling draws for one shape (module docstring), made once per report: every
    bootstrap of that shape uses the same draws. Crossed draws come as multiplicities
    (resamples x S and resamples x N), nested ones as indices."""
    rng = np.random.default_rng(seed)
    seed_draws = rng.integers(0, n_seeds, size=(resamples, n_seeds))
    if crossed:
        prompt_draws = rng.integers(0, n_prompts, size=(resamples, n_prompts))
        out = _counts(seed_draws, n_seeds), _counts(prompt_draws, n_prompts)
    else:
        out = seed_draws, rng.integers(0, n_prompts, size=(resamples, n_seeds, n_prompts))
    for array in out:
        array.flags.writeable = False  # shared by every later call
    return out


def _resampled_means(outcomes: np.ndarray, crossed: bool, resamples: int,
                     seed: int) -> np.ndarray:
    n_seeds, n_prompts = outcomes.shape
    seed_draws, prompt_draws = _draws(n_seeds, n_prompts, crossed, resamples, seed)
    if crossed:  # the mean over drawn seeds x drawn prompts, as multiplicities: w_s' X w_p
        return ((seed_draws @ outcomes) * prompt_draws).sum(1) / (n_seeds * n_prompts)
    means = np.empty(resamples)
    for start in range(0, resamples, _CHUNK):
        part = slice(start, start + _CHUNK)
        means[part] = outcomes[seed_draws[part, :, None], prompt_draws[part]].mean(axis=(1, 2))
    return means


def bootstrap(outcomes: np.ndarray | Sequence[Sequence[float] | np.ndarray], crossed: bool = True,
              resamples: int = RESAMPLES, seed: int = RNG_SEED,
              level: float = LEVEL) -> Estimate:
    """The mean of a seeds x prompts matrix and its two-way bootstrap interval (the
    report's secondary interval: too narrow with a handful of seeds, module docstring)."""
    values = _matrix(outcomes)
    means = _resampled_means(values, crossed, resamples, seed)
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return Estimate(float(values.mean()), float(lo), float(hi), values.shape[0],
                    values.shape[1], crossed)


def difference_of_means(a: Sequence[float], b: Sequence[float], resamples: int = RESAMPLES,
                        seed: int = RNG_SEED, level: float = LEVEL) -> Estimate:
    """``mean(a) - mean(b)`` of two independent samples (the training reward of the last
    and of the first steps of a run) with a bootstrap interval that redraws each sample
    with replacement; ``prompts`` counts the values of both."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if not (x.size and y.size):
        raise ValueError("difference_of_means needs two non-empty samples")
    rng = np.random.default_rng(seed)
    means = (x[rng.integers(0, x.size, size=(resamples, x.size))].mean(1)
             - y[rng.integers(0, y.size, size=(resamples, y.size))].mean(1))
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return Estimate(float(x.mean() - y.mean()), float(lo), float(hi), 1, x.size + y.size,
                    False)


def _design(runs: Sequence[Outcomes]) -> tuple[np.ndarray, bool] | str:
    """The seeds x prompts matrix of ``runs`` and whether its prompts are crossed, or why
    there is none."""
    if not runs:
        return "no finished seed"
    if len({len(r.scores) for r in runs}) > 1:
        return "seeds were scored on different numbers of prompts"
    if len(runs) == 1 and len(runs[0].scores) == 1:
        return "one seed scored on one prompt has no spread to estimate"
    return (np.array([r.scores for r in runs], dtype=np.float64),
            len({r.prompts for r in runs}) == 1)


#: an interval of a seeds x prompts matrix: (matrix, crossed) -> Estimate
Interval = Callable[[np.ndarray, bool], Estimate]


def accuracy(runs: Sequence[Outcomes], interval: Interval = seed_t) -> Estimate | str:
    """One cell's mean accuracy over its seeds and prompts with its interval (the one
    verdicts use unless another is given), or why there is none."""
    design = _design(runs)
    if isinstance(design, str):
        return design
    return interval(*design)


def paired_difference(a: Sequence[Outcomes], b: Sequence[Outcomes],
                      interval: Interval = seed_t) -> Estimate | str:
    """Cell ``a`` minus cell ``b`` at the seeds both finished (never two unequal sets of
    seeds), prompt by prompt, with its paired interval; or why no paired difference can
    be taken."""
    by_seed = {r.seed: r for r in b}
    pairs = [(r, by_seed[r.seed]) for r in a if r.seed in by_seed]
    if not pairs:
        return "no seed finished in both cells"
    if any(x.prompts != y.prompts or len(x.scores) != len(y.scores) for x, y in pairs):
        return "the two cells were scored on different prompts"
    diffs = [Outcomes(x.seed, tuple(np.subtract(x.scores, y.scores)), x.prompts)
             for x, y in pairs]
    return accuracy(diffs, interval)


def verdict(difference: Estimate) -> str:
    """The claim's verdict for ``better - worse``: ``holds`` if the interval lies above 0
    (the paper's direction), ``reversed`` if below, ``within noise`` if it contains 0."""
    if difference.lo > 0:
        return "holds"
    if difference.hi < 0:
        return "reversed"
    return "within noise"
