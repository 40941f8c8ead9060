"""``fp4rl eval``: Mean@1 (greedy) or Mean@k accuracy of a model, a run or a checkpoint."""

from __future__ import annotations

import argparse

from rich.console import Console

from fp4rl.cli.options import add_device_options, check_outputs, positive_float, positive_int
from fp4rl.paths import write_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``eval`` command's options."""
    ev = sub.add_parser("eval", help="Mean@1 (greedy) or Mean@k accuracy")
    src = ev.add_mutually_exclusive_group()
    src.add_argument("--model", help="registered name or checkpoint directory")
    src.add_argument("--checkpoint", help="a training run directory or one of its checkpoints")
    ev.add_argument("--recipe", help="evaluate under this rollout recipe (a name, e.g. "
                    "hif4+resq-2:4); default: unquantized, or the run's recipe with "
                    "--recipe run")
    ev.add_argument("--data", default="synthetic",
                    help="synthetic (arithmetic), synthetic-words (word problems), or "
                    "LAYOUT:PATH (gsm8k, math500, aime24, aime25, amc23, "
                    "dapo-math-17k)")
    ev.add_argument("--field", action="append", metavar="ROLE=NAME",
                    help="field mapping, e.g. problem=Problem (repeatable)")
    ev.add_argument("--template", help="prompt template (boxed, gsm8k, direct; default: the "
                    "data's own): score a trained policy with the prompt it was trained on")
    ev.add_argument("--n", type=positive_int, default=100,
                    help="number of prompts (synthetic: spread over the levels; levels 1 "
                    "and 2 hold 95 and 52 test questions)")
    ev.add_argument("--levels", type=int, nargs="+", default=[1, 2], help="synthetic levels")
    ev.add_argument("--mean-at", type=positive_int, default=1,
                    help="1: greedy Mean@1; k: Mean@k")
    ev.add_argument("--temperature", type=positive_float, default=1.0)
    ev.add_argument("--max-new-tokens", type=positive_int, default=256)
    ev.add_argument("--batch-size", type=positive_int, default=32)
    ev.add_argument("--seed", type=int, default=0)
    add_device_options(ev, "auto")
    ev.add_argument("--json", help="write the result here")
    ev.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.precision import resolve_device, resolve_mixed_precision
    from fp4rl.progress import progress_bar
    from fp4rl.rl.datasets import encode_examples
    from fp4rl.rl.evaluate import evaluate
    from fp4rl.rl.report import mismatch_line
    from fp4rl.rl.sources import checkpoint_dir, eval_split, load_policy

    check_outputs(json=args.json)
    examples = eval_split(args.data, n=args.n, levels=args.levels, seed=args.seed,
                          fields=args.field)
    device = resolve_device(args.device)  # this entry point's edge: no training config
    mixed_precision = resolve_mixed_precision(args.mixed_precision, device)
    model, tok, label = load_policy(args.model, args.checkpoint, args.recipe, device)
    examples, prompts = encode_examples(examples, tok, 4096, args.template)
    with progress_bar(console) as bar:
        task = bar.add_task("eval", total=None, info=label)
        result = evaluate(model, tok, examples, prompts, k=args.mean_at, seed=args.seed,
                          temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                          batch_size=args.batch_size, mixed_precision=mixed_precision,
                          progress=lambda n: bar.advance(task, n))
    console.print(f"{label} on {args.data} ({result.n} prompts): "
                  f"mean@{result.k} = {result.mean:.1%}, best@{result.k} = {result.best:.1%}"
                  + (f", per level {result.per_level}" if result.per_level else ""))
    mismatch = mismatch_line(checkpoint_dir(args.checkpoint).parent.parent) \
        if args.checkpoint else ""
    if mismatch:  # how far the run's rollout policy strayed from its training policy
        console.print(mismatch)
    if args.json:
        write_json(args.json, {"policy": label, "data": args.data, **result.as_dict(),
                               **({"mismatch": mismatch} if mismatch else {})})
    return 0
