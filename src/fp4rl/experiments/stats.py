"""Intervals over seeds and test prompts, paired comparisons and the verdict rule.

A GRPO cell's accuracy moves with the seed (data order, sampling) and with the test
prompts it is scored on; an interval that covers only one of the two (a binomial one
covers the prompts only) makes gaps look more certain than they are. Each cell at each
seed contributes one row of per-prompt accuracy (1 or 0 for greedy Mean@1, the share of
correct samples for Mean@k), and the interval comes from a two-way bootstrap:

* every resample draws the seeds with replacement and the test prompts with replacement,
  and takes the mean of the drawn rows at the drawn prompts;
* when every seed was scored on the same prompts (``crossed``), one draw of prompts is
  shared by all the drawn seeds, so a hard prompt stays hard across seeds; otherwise the
  prompts are drawn within each drawn seed (``nested``: each seed has prompts of its own);
* the interval is the 2.5th to 97.5th percentile of the resampled means.

A comparison is **paired**: the difference of two cells is taken prompt by prompt at
each seed both cells finished, and the bootstrap above is applied to the differences, so
what the two cells share (a lucky seed, an easy prompt) cancels. The random draws come
from a fixed generator seed, so a report is reproducible number for number.

The draws, in order (a slow reimplementation can repeat them)::

    rng = numpy.random.default_rng(seed)
    seed_draws = rng.integers(0, S, size=(resamples, S))
    prompt_draws = rng.integers(0, N, size=(resamples, N))      # crossed
    prompt_draws = rng.integers(0, N, size=(resamples, S, N))   # nested
"""

from __future__ import annotations

from collections.abc import Sequence
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
    """A mean (of accuracy, or of a paired difference) and its bootstrap interval."""

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


def bootstrap(outcomes: np.ndarray | Sequence[Sequence[float]], crossed: bool = True,
              resamples: int = RESAMPLES, seed: int = RNG_SEED,
              level: float = LEVEL) -> Estimate:
    """The mean of a seeds x prompts matrix and its two-way bootstrap interval."""
    values = np.asarray(outcomes, dtype=np.float64)
    if values.ndim != 2 or 0 in values.shape:
        raise ValueError(f"outcomes must be a non-empty seeds x prompts matrix, got shape "
                         f"{values.shape}")
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
    return (np.array([r.scores for r in runs], dtype=np.float64),
            len({r.prompts for r in runs}) == 1)


def accuracy(runs: Sequence[Outcomes]) -> Estimate | str:
    """One cell's mean accuracy over its seeds and prompts with its interval, or why
    there is none."""
    design = _design(runs)
    if isinstance(design, str):
        return design
    return bootstrap(*design)


def paired_difference(a: Sequence[Outcomes], b: Sequence[Outcomes]) -> Estimate | str:
    """Cell ``a`` minus cell ``b`` at the seeds both finished, prompt by prompt, with its
    paired interval; or why no paired difference can be taken."""
    by_seed = {r.seed: r for r in b}
    pairs = [(r, by_seed[r.seed]) for r in a if r.seed in by_seed]
    if not pairs:
        return "no seed finished in both cells"
    if any(x.prompts != y.prompts or len(x.scores) != len(y.scores) for x, y in pairs):
        return "the two cells were scored on different prompts"
    diffs = [Outcomes(x.seed, tuple(np.subtract(x.scores, y.scores)), x.prompts)
             for x, y in pairs]
    return accuracy(diffs)


def verdict(difference: Estimate) -> str:
    """The claim's verdict for ``better - worse``: ``holds`` if the interval lies above 0
    (the paper's direction), ``reversed`` if below, ``within noise`` if it contains 0."""
    if difference.lo > 0:
        return "holds"
    if difference.hi < 0:
        return "reversed"
    return "within noise"
