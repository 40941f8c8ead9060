"""The ``fp4rl`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console


def _bench(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.bench import common

    if args.what == "formats":
        from fp4rl.bench import formats as bench

        results = bench.run(formats=args.formats or bench.DEFAULT_FORMATS, size=args.size,
                            repeats=args.repeats)
        bench.render(results, console, args.size)
    else:  # argparse restricts the choices
        raise AssertionError(args.what)
    console.print(f"machine: {common.machine()}")
    if args.json:
        common.write_json(args.json, results, benchmark=args.what, size=args.size)
        console.print(f"wrote {args.json}")
    return 0


def _demo(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.demo import run_demo

    return run_demo(console, model=args.model, output=args.output)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp4rl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the main job on the embedded default model")
    demo.add_argument("--model", default="smollm2-135m")
    demo.add_argument("--output", default="runs/demo", help="run directory for the report")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="speed benchmarks (ratios measured side by side)")
    bench.add_argument("what", choices=["formats"])
    bench.add_argument("--json", help="also write the results to this JSON file")
    bench.add_argument("--format", dest="formats", action="append",
                       help="limit to this format (repeatable)")
    bench.add_argument("--size", type=int, default=4096, help="square tensor side")
    bench.add_argument("--repeats", type=int, default=7)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args, Console())


if __name__ == "__main__":
    sys.exit(main())
