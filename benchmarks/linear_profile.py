"""Where an FP4 linear's forward + backward time goes: each GEMM and each of the six HiF4
quantization passes timed on its own, next to the whole FP32 and HiF4 steps.

    OMP_NUM_THREADS=1 python benchmarks/linear_profile.py

Medians of 9 runs, in milliseconds, for two of `fp4rl bench linear`'s shapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

import fp4rl
from fp4rl.nn import FP4Linear, get_recipe

SHAPES = ((512, 2048, 2048), (512, 576, 1536))


def median_ms(fn: Callable[[], object], repeats: int = 9) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        x.grad = None
        layer.weight.grad = None
        layer(x).backward(grad)
    return run


def profile(tokens: int, d_in: int, d_out: int) -> None:
    hif4 = fp4rl.get_format("hif4")
    x, w = torch.randn(tokens, d_in), torch.randn(d_out, d_in)
    dy = torch.randn(tokens, d_out)
    passes = {
        "Q(X) along in_features": lambda: hif4.quantize(x, dim=1),
        "Q(W) along in_features": lambda: hif4.quantize(w, dim=1),
        "Q(W) along out_features (axis 0)": lambda: hif4.quantize(w, dim=0),
        "Q(X) along tokens (axis 0)": lambda: hif4.quantize(x, dim=0),
        "Q(dY) along tokens (axis 0)": lambda: hif4.quantize(dy, dim=0),
        "Q(dY) along out_features": lambda: hif4.quantize(dy, dim=1),
    }
    print(f"[{tokens} x {d_in} -> {d_out}]")
    print(f"  {'one of the three GEMMs':32s} {median_ms(lambda: x @ w.t()):6.1f}")
    total = 0.0
    for name, fn in passes.items():
        ms = median_ms(fn)
        total += ms
        print(f"  {name:32s} {ms:6.1f}")
    print(f"  {'six quantizations together':32s} {total:6.1f}")
    xg = x.clone().requires_grad_()
    fp32 = median_ms(step(nn.Linear(d_in, d_out, bias=False), xg, dy))
    fp4 = median_ms(step(FP4Linear.from_linear(nn.Linear(d_in, d_out, bias=False),
                                               get_recipe("hif4")), xg, dy))
    print(f"  {'whole step FP32 / HiF4':32s} {fp32:6.1f} / {fp4:.1f}  ({fp4 / fp32:.2f}x)")


def main() -> None:
    torch.set_num_threads(1)
    for shape in SHAPES:
        profile(*shape)


if __name__ == "__main__":
    main()
