"""Side-by-side timing: every comparison is measured in one run, interleaved, as medians.

Interleaving the candidates inside each repeat means a burst of load from another
process hits all of them alike, so the ratios stay meaningful on a shared machine.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

import torch

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
    """One result row: ``ratio`` = candidate time / baseline time (medians)."""

    name: str
    candidate: str
    baseline: str
    candidate_times: list[float]
    baseline_times: list[float]
    ratio: float
    target: str = ""


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
    cand, base = timings[candidate], timings[baseline]
    return Comparison(name, candidate, baseline, cand.times, base.times,
                      cand.median / base.median, target)


def machine() -> dict[str, object]:
    """What the numbers were measured on: a bf16 ratio means nothing without the CPU's
    bf16 capability (and the GPU, where one ran)."""
    cpu, flags = cpu_info()
    info: dict[str, object] = {"cpu": cpu, "cpu_bf16_flags": list(flags),
                               "threads": torch.get_num_threads(), "torch": torch.__version__,
                               "python": platform.python_version()}
    limits = {name: os.environ[name] for name in ISA_LIMITS if name in os.environ}
    if limits:  # the libraries held below what the CPU has: a ratio means that machine's
        info["isa_limits"] = limits
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


#: environment variables that hold a library below the CPU's own instruction set, so a
#: run stands for another kind of CPU (oneDNN's, MKL's, fp4rl's tile unit switch and
#: its kernels' compile target)
ISA_LIMITS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "FP4RL_AMX",
              "FP4RL_MARCH")


def report(results: list[Comparison], **extra: object) -> dict[str, object]:
    """The JSON record of a bench run: ``{"machine": ..., **extra, "results": [...]}``."""
    return {"machine": machine(), **extra, "results": [asdict(r) for r in results]}
