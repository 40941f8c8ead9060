"""``fp4rl experiment``: the paper's precision and recovery grids, cell by cell,
resumable."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from fp4rl.cli.options import positive_int

if TYPE_CHECKING:
    from fp4rl.experiments import Cell, Experiment


#: fp4rl.experiments.PLANS' names and KINDS, spelled out so that building the parser
#: imports no experiment code
EXPERIMENT_PLANS = ("tiny", "tiny3", "field", "paper-3b", "paper-7b")
EXPERIMENT_KINDS = ("precision", "recovery", "field")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``experiment`` command's options."""
    exp = sub.add_parser("experiment", help="the paper's Table 1 (precision) or Tables 2/4 "
                         "(recovery) grid, or the field's recipes beside the paper's "
                         "(field): a GRPO run + evaluation per cell, resumable")
    exp.add_argument("kind", choices=EXPERIMENT_KINDS)
    exp.add_argument("--plan", default="tiny",
                     choices=EXPERIMENT_PLANS, help="the experiment plan; "
                     "tiny: smollm2-135m + synthetic arithmetic on a CPU, one seed; "
                     "tiny3: smollm2-135m + synthetic word problems, 5 seeds, 300 test "
                     "prompts; field: tiny3's settings for the field grid; paper-*: the "
                     "paper's Qwen runs (local weights and data via --set)")
    exp.add_argument("--output", required=True, help="directory for the cells and the report "
                     "(rerun the same command to resume)")
    exp.add_argument("--format", dest="formats", action="append",
                     help="FP4 format (repeatable; default: the plan's)")
    exp.add_argument("--set", dest="overrides", action="append", default=[],
                     metavar="key=value", help="config override for every cell, e.g. "
                     "model=/models/Qwen2.5-3B (repeatable)")
    exp.add_argument("--eval", dest="evals", action="append", metavar="NAME=LAYOUT:PATH",
                     help="benchmark column (repeatable; default: the plan's test split)")
    exp.add_argument("--device", help="every cell's device: auto (cuda when available), cpu, "
                     "cuda or cuda:N, as --set device=...; default: the plan's (auto)")
    exp.add_argument("--jobs", type=positive_int, default=1, help="cells run in parallel "
                     "(each gets cpu_count/jobs torch threads)")
    exp.add_argument("--cells", nargs="+", metavar="NAME",
                     help="run only these cells (recipe names such as hif4+resq-2:4 or "
                     "mxfp4:bf16/fp4); the report still covers the whole grid")
    exp.add_argument("--seeds", type=int, nargs="+", metavar="SEED",
                     help="run every cell once per seed (default: the plan's; tiny and "
                     "paper-*: the config's run.seed only), with intervals over seeds and "
                     "prompts in the report; run.seed keeps <output>/cells, seed S goes to "
                     "<output>/seed-S/cells")
    exp.add_argument("--report-only", action="store_true",
                     help="write the tables from the finished runs without running any")
    exp.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from fp4rl import experiments as ex

    plan = ex.get_plan(args.plan)
    formats = tuple(args.formats or plan.formats)
    seeds = ex.check_seeds(args.seeds) if args.seeds is not None else plan.seeds
    if args.device:  # a device that is not there is refused before any run
        from fp4rl.precision import resolve_device

        resolve_device(args.device)
    overrides = ([f"device={args.device}"] if args.device else []) + args.overrides
    exp = ex.Experiment(args.kind, plan, Path(args.output), formats, tuple(overrides),
                        tuple(ex.EvalSpec.parse(e) for e in args.evals or []), seeds)
    grid = ex.grid_cells(args.kind, formats)
    cut = plan.grid(args.kind, formats)
    chosen = ex.select_cells(grid, args.cells) if args.cells else cut
    # fail fast on a bad override or a placeholder path, in the cells that run: an override
    # only some recipes take (nvfp4_scale=static, say) runs with --cells naming those
    for cell in chosen:
        ex.cell_config(exp, cell)
    cells = cut + [c for c in chosen if c not in cut]  # what the report covers
    runs = ex.seeded_cells(chosen, exp.run_seeds)
    from fp4rl.rundir_lock import exclusive

    with exclusive(exp.output, warn=console.print):  # one writer per experiment directory
        return _experiment_in(args, exp, cells, chosen, runs, console)


def _experiment_in(args: argparse.Namespace, exp: Experiment, cells: list[Cell],
                   chosen: list[Cell], runs: list, console: Console) -> int:
    from fp4rl import experiments as ex

    if not args.report_only:
        console.print(f"{args.kind} grid, {exp.plan.name} plan: {len(chosen)} of {len(cells)} "
                      f"cells x seeds {', '.join(map(str, exp.run_seeds))} in {exp.output} "
                      f"({args.jobs} at a time)")
        _run_grid(exp, runs, args.jobs, console)
    results = ex.load_results(exp, cells, exp.run_seeds)
    path = ex.write_report(exp, cells, results, command=["fp4rl", *args.argv])
    console.print(path.read_text(), markup=False, soft_wrap=True)
    console.print(f"report: {path}")
    return 0


def _run_grid(exp: Experiment, runs: list[Cell], jobs: int, console: Console) -> None:
    """Run the unfinished (cell, seed) runs with a progress bar."""
    from fp4rl import experiments as ex
    from fp4rl.progress import progress_bar

    with progress_bar(console) as bar:
        grid = bar.add_task("runs", total=len(runs), info="")
        steps = bar.add_task("GRPO", total=None, info="", visible=jobs <= 1)

        def status(cell: Cell, what: str) -> None:
            if what in ("done", "finished earlier"):
                bar.advance(grid)
            if what == "running":
                bar.reset(steps)
            bar.update(grid, info=f"{cell.label}: {what}")

        def step(s: int, total: int, m: dict) -> None:
            bar.update(steps, total=total, completed=s, info=f"reward {m['reward_mean']:.3f}")

        ex.run_cells(exp, runs, jobs=jobs, on_status=status, progress=step)
