"""Rollout-ResQ: ``Y = Q(X) Q(W)^T + S(Q(X - Q(X))) Q(W)^T``.

The residual ``X - Q(X)`` holds what FP4 lost, chiefly the small values that an
outlier flushed to zero; quantizing it again recovers most of them, and the sparsity
function ``S`` keeps the second GEMM cheap on hardware (2:4 runs at half the dense cost).
Both GEMMs share ``Q(W)``, so simulation folds them into one matmul of
``Q(X) + S(Q(X - Q(X)))``; the two-GEMM form stays available for checking.
"""

from __future__ import annotations

import torch

from fp4rl.formats import quantize
from fp4rl.recovery.base import RolloutRecovery, register
from fp4rl.recovery.sparsity import sparsify


def resq_activation(x: torch.Tensor, fmt: str, pattern: str = "2:4") -> torch.Tensor:
    """``Q(x) + S(Q(x - Q(x)))``: the effective rollout activation of ResQ."""
    qx = quantize(x, fmt)
    return qx + sparsify(quantize(x - qx, fmt), pattern)


def resq_matmul(x: torch.Tensor, w: torch.Tensor, fmt: str, pattern: str = "2:4",
                two_gemm: bool = False, weight_format: str | None = None) -> torch.Tensor:
    """Rollout-ResQ linear (no bias): ``Q(x)Q(w)^T + S(Q(x - Q(x)))Q(w)^T``.

    ``x`` is (..., in), ``w`` (out, in); both are quantized along ``in``. ``weight_format``
    defaults to ``fmt``. ``two_gemm=True`` computes the two products separately, as
    hardware would; the default folds them into one matmul (equal up to summation order).
    """
    qw = quantize(w, weight_format or fmt)
    if not two_gemm:
        return resq_activation(x, fmt, pattern) @ qw.t()
    qx = quantize(x, fmt)
    return qx @ qw.t() + sparsify(quantize(x - qx, fmt), pattern) @ qw.t()


@register
class ResQ(RolloutRecovery):
    name = "resq"

    def matmul(self, x: torch.Tensor, qw: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return resq_activation(x, self.act_format, self.config.sparsity) @ qw.t()
