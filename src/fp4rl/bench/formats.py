"""``fp4rl bench formats``: fast path vs ``x.clone()`` vs the reference path.

``x.clone()`` is the floor for any out-of-place elementwise pass (read the tensor,
allocate and write the result); the fast quantizer is judged against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from statistics import median

import torch
from rich.console import Console
from rich.table import Table

from fp4rl.bench.common import Comparison, compare, measure
from fp4rl.formats import get_format

DEFAULT_FORMATS = ("hif4", "mxfp4", "nvfp4", "mxfp8_e4m3")
TARGETS = {"fast_vs_clone": "<= 2.0 (hif4, mxfp4)", "fast_vs_reference": "<= 0.2 (hif4, mxfp4)"}


def _synced(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` followed by a device synchronization, so that its time is the kernel's."""
    if device.type != "cuda":
        return fn

    def go() -> None:
        fn()
        torch.cuda.synchronize(device)
    return go


def run(formats: Sequence[str] = DEFAULT_FORMATS, size: int = 4096, repeats: int = 7,
        reference_repeats: int = 3, seed: int = 0, device: str = "cpu",
        dim: int = -1) -> list[Comparison]:
    """Measure every format on a ``size x size`` float32 normal tensor on ``device``,
    quantized along ``dim`` (the fast path on a GPU is the Triton kernel)."""
    dev = torch.device(device)
    x = torch.randn(size, size, generator=torch.Generator().manual_seed(seed)).to(dev)
    fns = {"clone": _synced(x.clone, dev)}
    for name in formats:
        fmt = get_format(name)
        fns[f"{name}/fast"] = _synced(partial(fmt.quantize, x, dim=dim), dev)
        fns[f"{name}/reference"] = _synced(partial(fmt.quantize_reference, x, dim=dim), dev)
    slow = {f"{name}/reference": reference_repeats for name in formats}
    timings = measure(fns, repeats, slow=slow)
    results = []
    for name in formats:
        results.append(compare(f"{name}.fast_vs_clone", timings, f"{name}/fast", "clone",
                               TARGETS["fast_vs_clone"]))
        results.append(compare(f"{name}.fast_vs_reference", timings, f"{name}/fast",
                               f"{name}/reference", TARGETS["fast_vs_reference"]))
    return results


def render(results: list[Comparison], console: Console, size: int) -> None:
    """Print one row per format: medians and the two ratios."""
    table = Table(title=f"fake quantization, {size} x {size} float32 (median ms; GB/s "
                        "counts one read and one write of every value)")
    for col in ("format", "clone", "fast", "reference", "fast / clone", "reference / fast",
                "fast GB/s", "clone GB/s"):
        table.add_column(col, justify="right")
    traffic = 8 * size * size / 1e9
    rows = {r.name: r for r in results}
    for name in dict.fromkeys(r.name.split(".")[0] for r in results):
        vs_clone, vs_ref = rows[f"{name}.fast_vs_clone"], rows[f"{name}.fast_vs_reference"]
        clone, fast = median(vs_clone.baseline_times), median(vs_clone.candidate_times)
        ref = median(vs_ref.baseline_times)
        table.add_row(name, f"{clone * 1e3:.1f}", f"{fast * 1e3:.1f}", f"{ref * 1e3:.0f}",
                      f"{vs_clone.ratio:.2f}x", f"{1 / vs_ref.ratio:.1f}x",
                      f"{traffic / fast:.1f}", f"{traffic / clone:.1f}")
    console.print(table)
