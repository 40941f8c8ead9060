"""Compute-overhead model for Rollout-ResQ linear layers.

For ``Y = X W^T`` with ``X`` of shape ``(m, d)`` and ``W`` of shape ``(n, d)``
a dense BF16/FP16 GEMM costs ``2 m d n`` FLOPs. FP4 tensor cores run
``fp4_speedup`` times faster, so costs are reported as *effective* FLOPs
(BF16-equivalent work):

* ``fp4``: one FP4 GEMM, ``2 m d n / fp4_speedup``;
* ``resq-<pattern>``: that GEMM plus the residual GEMM, which a sparse kernel
  runs on the kept share (``density``) of the residual:
  ``(1 + density) * 2 m d n / fp4_speedup``.

With the default 4x FP4 advantage that is ``mdn / 2`` for FP4, ``mdn`` for
dense ResQ (2x over BF16) and ``3/4 mdn`` for 2:4 ResQ (8/3 ≈ 2.67x).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fp4rl.errors import UserError
from fp4rl.recovery.sparsity import NM, Dense, SparsityPattern


@dataclass(frozen=True)
class CostRow:
    """Effective cost of one way of running the layer."""

    name: str
    flops: float
    flops_per_mdn: float
    speedup: float


def cost_table(
    m: int,
    d: int,
    n: int,
    sparsities: Iterable[SparsityPattern] = (Dense(), NM(2, 4)),
    fp4_speedup: float = 4.0,
) -> list[CostRow]:
    """Rows for ``bf16``, ``fp4`` and ``resq-<pattern>`` per residual sparsity pattern.

    Speedups are formed directly as ``fp4_speedup / (1 + density)`` rather
    than as a ratio of FLOP counts, so they are independent of ``m, d, n`` and
    correctly rounded (the 2:4 row is exactly ``8 / 3`` as a float). Each
    pattern's nominal density is used (see ``fp4rl.recovery.sparsity.density``); the
    patterns come parsed (:func:`~fp4rl.recovery.sparsity.parse_pattern`, at the CLI).
    """
    if min(m, d, n) < 1:
        raise UserError(f"GEMM dimensions must be positive, got m={m}, d={d}, n={n}")
    if fp4_speedup <= 0:
        raise UserError(f"fp4_speedup must be positive, got {fp4_speedup}")
    rows = [_row("bf16", m * d * n, 1.0, 1.0), _row("fp4", m * d * n, 1.0, fp4_speedup)]
    for pattern in sparsities:
        rows.append(_row(f"resq-{pattern}", m * d * n, 1.0 + pattern.density, fp4_speedup))
    return rows


def _row(name: str, mdn: int, gemms: float, throughput: float) -> CostRow:
    """Cost of ``gemms`` dense-equivalent GEMMs run at ``throughput`` times BF16 speed."""
    per_mdn = 2 * gemms / throughput
    return CostRow(name, per_mdn * mdn, per_mdn, throughput / gemms)


def format_cost_table(rows: Iterable[CostRow]) -> str:
    """Render rows as a GitHub-flavoured markdown table."""
    lines = [
        "| method | effective FLOPs | FLOPs / mdn | speedup vs BF16 |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {row.name} | {row.flops:.4g} | {row.flops_per_mdn:.4g} | {row.speedup:.2f}x |"
        for row in rows
    ]
    return "\n".join(lines)
