"""``fp4rl export``: a run's policy as a directory other tools load."""

from __future__ import annotations

import argparse

from rich.console import Console

from fp4rl.cli.options import check_outputs
from fp4rl.progress import status


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``export`` command's options."""
    export = sub.add_parser("export", help="a run's policy as a directory other tools load: "
                            "bf16, compressed-tensors mxfp4/nvfp4, fp4rl's packed hif4, "
                            "or vllm (served by vLLM with the fp4rl plug-in)")
    what = export.add_mutually_exclusive_group(required=True)
    what.add_argument("--checkpoint", help="a training run directory (its latest checkpoint) "
                      "or one of its checkpoints")
    what.add_argument("--model", help="registered name or checkpoint directory (untrained)")
    export.add_argument("--format", required=True,
                        help="bf16, mxfp4, nvfp4 (compressed-tensors), hif4 (fp4rl packed) "
                        "or vllm (float32 block linears + fp4rl quantization_config)")
    export.add_argument("--recipe", help="--format vllm only: the rollout recipe vLLM runs, a "
                        "recipe name (default hif4+resq-2:4) or 'run' (the run's own, with "
                        "--checkpoint)")
    export.add_argument("--output", required=True, help="new (or empty) directory to write")
    export.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.export import export_checkpoint, export_pretrained

    check_outputs(output=args.output)
    source = args.checkpoint or args.model
    with status(console, f"exporting {source} as {args.format}"):
        export = export_checkpoint if args.checkpoint else export_pretrained
        result = export(source, args.format, args.output, recipe=args.recipe)
    console.print(result.summary(), markup=False, highlight=False, soft_wrap=True)
    return 0
