"""``fp4rl demo``: the main job, on the embedded default model."""

from __future__ import annotations

import argparse

from rich.console import Console

from fp4rl.cli.options import add_device_options, positive_int
from fp4rl.rollout.registry import list_engines


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``demo`` command's options."""
    demo = sub.add_parser("demo", help="the main job on the embedded default model")
    demo.add_argument("--config", default="demo",
                      help="config preset name (see fp4rl presets) or YAML file; default demo")
    demo.add_argument("--model", help="override the config's model")
    demo.add_argument("--output", default="runs/demo", help="run directory for the report")
    demo.add_argument("--steps", type=positive_int,
                      help="GRPO steps (default: sized for ~10 min)")
    demo.add_argument("--eval-prompts", type=positive_int, help="test prompts per evaluation")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--rollout-engine", choices=list_engines(),
                      help="where GRPO's rollouts run: hf (fp4rl's engine) or vllm (a "
                      "colocated vLLM engine with the fp4rl method); default: the config's")
    add_device_options(demo, "auto")
    demo.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.demo import DemoSize, run_demo

    given = {"steps": args.steps, "eval_prompts": args.eval_prompts}
    size = DemoSize(**{k: v for k, v in given.items() if v is not None})
    return run_demo(console, model=args.model, output=args.output, size=size, seed=args.seed,
                    device=args.device, mixed_precision=args.mixed_precision,
                    config=args.config, rollout_engine=args.rollout_engine)
