"""Side-by-side timing: every comparison is measured in one run, interleaved, as medians.

Interleaving the candidates inside each repeat means a burst of load from another
process hits all of them alike, so the ratios stay meaningful on a shared machine. A
ratio is therefore taken repeat by repeat (candidate over baseline, timed moments apart)
and the median of those is reported, with a distribution-free interval for it: on a
shared virtual machine the baseline alone can move by 2x between minutes (a step of the
bf16 q_proj at 27 ms, then at 53 ms), which a ratio of the two medians mixes in and a
per-repeat ratio cancels.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

import torch

from fp4rl.host_memory import host_memory
from fp4rl.precision import cpu_info


@dataclass
class Timing:
    """Raw wall-clock times (seconds) of one measured callable."""

    name: str
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


@dataclass
class Comparison:
    """One result row: ``ratio`` = the median over repeats of candidate time / baseline
    time (:func:`paired_ratio`); ``interval`` bounds that median at ``coverage`` (None
    where too few repeats were paired for one at 90% or more)."""

    name: str
    candidate: str
    baseline: str
    candidate_times: list[float]
    baseline_times: list[float]
    ratio: float
    target: str = ""
    interval: tuple[float, float] | None = None
    coverage: float | None = None

    @classmethod
    def of(cls, name: str, candidate: str, baseline: str, candidate_times: list[float],
           baseline_times: list[float], target: str = "") -> Comparison:
        """The row of two sides' times, repeat by repeat (:func:`paired_ratio`)."""
        ratio, interval, coverage = paired_ratio(candidate_times, baseline_times)
        return cls(name, candidate, baseline, candidate_times, baseline_times, ratio, target,
                   interval, coverage)

    def shown(self) -> str:
        """``1.23x`` or, with an interval, ``1.23x (1.18-1.30)``."""
        if self.interval is None:
            return f"{self.ratio:.2f}x"
        return f"{self.ratio:.2f}x ({self.interval[0]:.2f}-{self.interval[1]:.2f})"


def median_interval(values: list[float], least: float = 0.90
                    ) -> tuple[tuple[float, float], float] | None:
    """The narrowest pair of order statistics ``(x_(k), x_(n+1-k))`` that holds the
    median with probability ``>= least`` whatever the distribution (the sign test's
    interval: ``1 - 2 P(Binomial(n, 1/2) < k)``), and that probability; None below 5
    values, where even the whole range holds it less often."""
    n = len(values)
    xs = sorted(values)
    best = None
    below = 0.0  # P(B <= k - 1)
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1) / 2 ** n
        cover = 1 - 2 * below
        if cover < least:
            break
        best = ((xs[k - 1], xs[n - k]), cover)
    return best


def paired_ratio(candidate: list[float], baseline: list[float]
                 ) -> tuple[float, tuple[float, float] | None, float | None]:
    """The median of the repeats' ratios (repeat ``i`` of each, timed moments apart) and
    its interval; with fewer than 3 repeats paired (a side timed once, say), the ratio of
    medians. A side capped below the others' repeats (``measure``'s ``slow``) pairs its
    repeats with the first of the other's."""
    pairs = [c / max(b, 1e-12) for c, b in zip(candidate, baseline, strict=False)]
    if len(pairs) < 3:
        return statistics.median(candidate) / max(statistics.median(baseline), 1e-12), \
            None, None
    found = median_interval(pairs)
    return statistics.median(pairs), *(found if found else (None, None))


def measure(fns: Mapping[str, Callable[[], object]], repeats: int,
            slow: dict[str, int] | None = None, warmup: int = 1) -> dict[str, Timing]:
    """Time each callable ``repeats`` times, interleaved; ``slow`` caps repeats per name."""
    slow = slow or {}
    timings = {name: Timing(name) for name in fns}
    for name, fn in fns.items():
        for _ in range(warmup if name not in slow else 0):
            fn()
    for i in range(repeats):
        for name, fn in fns.items():
            if i >= slow.get(name, repeats):
                continue
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            timings[name].times.append(time.perf_counter() - start)
    return timings


def _sync() -> None:
    """Wait for queued GPU work, so a timing covers what it launched."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def compare(name: str, timings: dict[str, Timing], candidate: str, baseline: str,
            target: str = "") -> Comparison:
    """Build a :class:`Comparison` from two measured timings."""
    return Comparison.of(name, candidate, baseline, timings[candidate].times,
                         timings[baseline].times, target)


def machine() -> dict[str, object]:
    """What the numbers were measured on: a bf16 ratio means nothing without the CPU's
    bf16 capability (and the GPU, where one ran)."""
    cpu, flags = cpu_info()
    info: dict[str, object] = {"cpu": cpu, "cpu_bf16_flags": list(flags),
                               "threads": torch.get_num_threads(), "torch": torch.__version__,
                               "python": platform.python_version(),
                               "host_memory": host_memory().describe()}
    limits = {name: os.environ[name] for name in ISA_LIMITS if name in os.environ}
    if limits:  # the libraries held below what the CPU has: a ratio means that machine's
        info["isa_limits"] = limits
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


#: environment variables that hold a library below the CPU's own instruction set, so a
#: run stands for another kind of CPU (torch's own kernels', oneDNN's, MKL's, fp4rl's
#: tile unit switch and its kernels' compile target)
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
              "MKL_ENABLE_INSTRUCTIONS", "FP4RL_AMX", "FP4RL_MARCH")


def report(results: list[Comparison], **extra: object) -> dict[str, object]:
    """The JSON record of a bench run: ``{"machine": ..., **extra, "results": [...]}``."""
    return {"machine": machine(), **extra, "results": [asdict(r) for r in results]}
