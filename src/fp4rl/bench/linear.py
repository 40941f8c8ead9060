"""``fp4rl bench linear``: forward + backward of an FP4 linear against fp32 and bf16.

The FP4 layer quantizes all three GEMMs (X and W along in_features for the forward,
dY and W along out_features for the input gradient, dY and X along tokens for the
weight gradient) and multiplies in fp32, as the training policy does. The baselines are
the same ``nn.Linear`` in fp32 and in bf16. The three are interleaved inside each repeat.
"""

from __future__ import annotations

from collections.abc import Callable
from statistics import median

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from fp4rl.bench.common import Comparison, compare, measure
from fp4rl.nn import FP4Linear, preset

#: (name, tokens, in_features, out_features): projections of the models fp4rl trains
SHAPES = (
    ("smollm2-135m.up_proj", 512, 576, 1536),
    ("smollm2-135m.down_proj", 512, 1536, 576),
    ("qwen2.5-3b.q_proj", 512, 2048, 2048),
    ("qwen2.5-3b.up_proj", 512, 2048, 11008),
    ("qwen2.5-3b.down_proj", 512, 11008, 2048),
)


def _step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One forward + backward (input and weight gradients) of ``layer``."""
    def go() -> None:
        layer.weight.grad = None
        x.grad = None
        layer(x).backward(grad)
    return go


def _inputs(m: int, d: int, n: int, dtype: torch.dtype, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g).to(dtype).requires_grad_()
    return x, torch.randn(m, n, generator=g).to(dtype)


def run(fmt: str = "hif4", shapes: tuple = SHAPES, repeats: int = 5) -> list[Comparison]:
    """fp4 / fp32 and fp4 / bf16 time ratios per shape (medians of interleaved repeats)."""
    results = []
    for name, m, d, n in shapes:
        base = nn.Linear(d, n, bias=False)
        half = nn.Linear(d, n, bias=False).to(torch.bfloat16)
        fp4 = FP4Linear.from_linear(nn.Linear(d, n, bias=False), preset(fmt))
        x32, g32 = _inputs(m, d, n, torch.float32)
        x16, g16 = _inputs(m, d, n, torch.bfloat16)
        timings = measure({"fp32": _step(base, x32, g32), "bf16": _step(half, x16, g16),
                           fmt: _step(fp4, x32.detach().clone().requires_grad_(), g32)},
                          repeats)
        label = f"linear.{name}[{m}x{d}->{n}]"
        results += [compare(f"{label}.{fmt}_vs_fp32", timings, fmt, "fp32", "<= 1.5"),
                    compare(f"{label}.{fmt}_vs_bf16", timings, fmt, "bf16")]
    return results


def render(results: list[Comparison], console: Console) -> None:
    table = Table(title="FP4 linear, forward + backward, all three GEMMs quantized (median)")
    for col in ("shape", "fp32 s", "bf16 s", "fp4 s", "fp4 / fp32", "fp4 / bf16"):
        table.add_column(col, justify="right")
    for vs32, vs16 in zip(results[::2], results[1::2], strict=True):
        table.add_row(vs32.name.rsplit(".", 1)[0].removeprefix("linear."),
                      f"{median(vs32.baseline_times):.3f}", f"{median(vs16.baseline_times):.3f}",
                      f"{median(vs32.candidate_times):.3f}", f"{vs32.ratio:.2f}x",
                      f"{vs16.ratio:.2f}x")
    console.print(table)
