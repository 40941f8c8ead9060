"""``fp4rl cost``: effective FLOPs of FP4 and Rollout-ResQ GEMMs."""

from __future__ import annotations

import argparse

from rich.console import Console

from fp4rl.cli.options import positive_float, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``cost`` command's options."""
    cost = sub.add_parser("cost", help="effective FLOPs of FP4 and Rollout-ResQ GEMMs")
    cost.add_argument("--m", type=positive_int, default=4096, help="tokens")
    cost.add_argument("--d", type=positive_int, default=4096, help="in_features")
    cost.add_argument("--n", type=positive_int, default=4096, help="out_features")
    cost.add_argument("--sparsity", nargs="+", default=["dense", "2:4"],
                      help="ResQ patterns to cost (dense, 2:4, channel:0.5, ...)")
    cost.add_argument("--fp4-speedup", type=positive_float, default=4.0,
                      help="FP4 GEMM throughput relative to FP16")
    cost.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.analysis.cost import cost_table, format_cost_table
    from fp4rl.recovery.sparsity import parse_pattern

    rows = cost_table(args.m, args.d, args.n,
                      sparsities=[parse_pattern(p) for p in args.sparsity],
                      fp4_speedup=args.fp4_speedup)
    console.print(f"linear layer X[{args.m}x{args.d}] W[{args.n}x{args.d}]^T, FP4 throughput "
                  f"{args.fp4_speedup:g}x FP16")
    console.print(format_cost_table(rows), markup=False)
    return 0
