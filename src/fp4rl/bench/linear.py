"""``fp4rl bench linear``: forward + backward of an FP4 linear against ``nn.Linear``.

The FP4 layer quantizes all three GEMMs (X and W along in_features for the forward,
dY and W along out_features for the input gradient, dY and X along tokens for the
weight gradient), as the training policy does. Every layer holds FP32 master weights;
the main row runs both the FP4 layer and the baseline ``nn.Linear`` under bf16 autocast
(``mixed_precision: bf16``, what a user would otherwise run); a second row compares the
two in fp32 (``mixed_precision: no``). The four are interleaved inside each repeat.

Each timed step runs as the trainer runs one: ``micro_batches`` forward + backward passes
(default 1) inside one weight scope (:func:`fp4rl.nn.patch.hold_weights`), opened and
closed around the step, so the FP4 layer derives ``Q(W)`` once per step (along
in_features and along out_features in one kernel call) and drops it after, as
an optimizer step would. One micro-batch is the least the kept ``Q(W)`` saves; the
trainer's default (64 sequences a step, 16 a micro-batch) runs 4. The bf16 baseline casts
its weight at every forward, as autocast does.
"""

from __future__ import annotations

from collections.abc import Callable
from statistics import median

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from fp4rl.bench.common import Comparison, compare, measure
from fp4rl.nn import FP4Linear, get_recipe
from fp4rl.nn.patch import hold_weights
from fp4rl.precision import autocast

#: (name, tokens, in_features, out_features): projections of the models fp4rl trains
SHAPES = (
    ("smollm2-135m.up_proj", 512, 576, 1536),
    ("smollm2-135m.down_proj", 512, 1536, 576),
    ("qwen2.5-3b.q_proj", 512, 2048, 2048),
    ("qwen2.5-3b.up_proj", 512, 2048, 11008),
    ("qwen2.5-3b.down_proj", 512, 11008, 2048),
)


def _step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor,
          precision: torch.dtype, micro_batches: int = 1) -> Callable[[], None]:
    """One step of ``layer``: ``micro_batches`` forward + backward passes (input and
    weight gradients, the latter accumulated) inside one weight scope (a step's; it
    changes nothing for a plain ``nn.Linear``)."""
    def go() -> None:
        layer.weight.grad = None
        with hold_weights(layer):
            for _ in range(micro_batches):
                x.grad = None
                with autocast(x.device, precision):
                    y = layer(x)
                y.backward(grad.to(y.dtype))
    return go


def _inputs(m: int, d: int, n: int, device: torch.device, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g).to(device).requires_grad_()
    return x, torch.randn(m, n, generator=g).to(device)


#: the compute dtypes a row may take, in the order the rows are written
COMPUTES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def run(fmt: str = "hif4", shapes: tuple = SHAPES, repeats: int = 5,
        device: str | torch.device = "cpu", micro_batches: int = 1,
        computes: tuple[str, ...] = tuple(COMPUTES)) -> list[Comparison]:
    """fp4 / bf16 (both bf16 compute) and fp4 / fp32 (both fp32) ratios per shape, each
    timing one step of ``micro_batches`` forward + backward passes, for each of
    ``computes``."""
    results = []
    dev = torch.device(device)
    for name, m, d, n in shapes:
        plain = nn.Linear(d, n, bias=False).to(dev)
        fp4 = FP4Linear.from_linear(nn.Linear(d, n, bias=False).to(dev), get_recipe(fmt))
        x, g = _inputs(m, d, n, dev)
        mb = micro_batches
        fns = {}
        for c in computes:
            fns[c] = _step(plain, x, g, COMPUTES[c], mb)
            fns[_fp4(fmt, c)] = _step(fp4, x, g, COMPUTES[c], mb)
        timings = measure(fns, repeats)
        label = f"linear.{name}[{m}x{d}->{n}]"
        results += [compare(f"{label}.{fmt}_vs_{c}", timings, _fp4(fmt, c), c,
                            "<= 1.5 where in/out >= 2048" if c == "bf16" else "")
                    for c in COMPUTES if c in computes]
    return results


def _fp4(fmt: str, compute: str) -> str:
    """The FP4 layer's timing name: the format alone under bf16 (as the rows were first
    named), ``<format>_fp32`` in fp32."""
    return fmt if compute == "bf16" else f"{fmt}_{compute}"


def render(results: list[Comparison], console: Console, micro_batches: int = 1) -> None:
    """One row per shape; a compute dtype not timed leaves its columns empty."""
    per_step = f", {micro_batches} micro-batches a step" if micro_batches > 1 else ""
    table = Table(title="FP4 linear, forward + backward, all three GEMMs quantized, FP32 "
                        f"masters{per_step} (median s)")
    for col in ("shape", "bf16", "fp4 bf16", "fp4 / bf16", "fp32", "fp4 fp32", "fp4 / fp32"):
        table.add_column(col, justify="right")
    rows: dict[str, dict[str, Comparison]] = {}
    for r in results:
        shape, _, vs = r.name.rpartition(".")
        rows.setdefault(shape.removeprefix("linear."), {})[vs.rpartition("_vs_")[2]] = r
    for shape, by_compute in rows.items():
        cells = []
        for c in COMPUTES:
            got = by_compute.get(c)
            cells += ["-"] * 3 if got is None else [
                f"{median(got.baseline_times):.3f}", f"{median(got.candidate_times):.3f}",
                got.shown()]
        table.add_row(shape, *cells)
    console.print(table)
