"""``fp4rl fidelity``: how far each rollout configuration strays from the unquantized
policy and from the FP4 training policy."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from fp4rl.cli.options import add_device_option, check_outputs, positive_int
from fp4rl.paths import write_json
from fp4rl.progress import status


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``fidelity`` command's options."""
    fid = sub.add_parser("fidelity", help="how far each rollout configuration strays")
    fid.add_argument("--model", default="smollm2-135m", help="registered name or checkpoint dir")
    fid.add_argument("--methods", nargs="+", help="rows, e.g. bf16 hif4 hif4+resq-2:4 "
                     "mxfp4+occ (default: bf16 and every recovery for hif4 and mxfp4)")
    fid.add_argument("--n", type=positive_int, default=48, help="number of arithmetic prompts")
    fid.add_argument("--levels", type=int, nargs="+", default=[1, 2])
    fid.add_argument("--seed", type=int, default=0)
    fid.add_argument("--max-new-tokens", type=positive_int, default=48)
    fid.add_argument("--json", help="write the rows to this JSON file")
    fid.add_argument("--plot", help="write a bar chart PNG here")
    add_device_option(fid)
    fid.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from dataclasses import asdict

    from rich.table import Table

    from fp4rl.analysis import fidelity, plots
    from fp4rl.data import synthetic_dataset
    from fp4rl.models import load_model
    from fp4rl.nn import get_recipe
    from fp4rl.rl.datasets import encode_examples

    methods = args.methods or fidelity.default_methods()
    for m in methods:
        get_recipe(m)  # fail fast on a bad name, before loading anything
    check_outputs(json=args.json, plot=args.plot)
    from fp4rl.precision import resolve_device

    with status(console, f"loading {args.model}"):
        model, tok = load_model(args.model, device=resolve_device(args.device))
    examples, prompts = encode_examples(
        synthetic_dataset("test", n=args.n, levels=args.levels, seed=args.seed), tok,
        max_prompt_length=4096, log=console.print)
    with status(console, "scoring methods") as live:
        rows = fidelity.run_fidelity(
            model, tok, prompts, [e.answer for e in examples], methods,
            max_new_tokens=args.max_new_tokens,
            progress=lambda m: live.update(f"scoring {m}"))
    table = Table(title=f"rollout fidelity on {len(examples)} arithmetic prompts "
                        f"(levels {args.levels})")
    for col in ("method", "KL vs unquantized", "KL vs FP4 train", "|dlogp| vs unquantized",
                "|dlogp| vs FP4 train", "greedy acc"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.method, f"{r.kl:.4f}", f"{r.kl_vs_train:.4f}", f"{r.logprob_diff:.4f}",
                      f"{r.logprob_diff_vs_train:.4f}", f"{r.accuracy:.1%}")
    console.print(table)
    if args.json:
        write_json(args.json, {
            "model": args.model, "prompts": len(examples), "levels": list(args.levels),
            "max_new_tokens": args.max_new_tokens, "rows": [asdict(r) for r in rows]})
    if args.plot:
        plots.plot_fidelity(rows, Path(args.plot))
    return 0
