"""``fp4rl train``: one GRPO run in a run directory, new or resumed, on one process or
under torchrun / accelerate."""

from __future__ import annotations

import argparse
import contextlib
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from fp4rl.cli.options import positive_int

if TYPE_CHECKING:
    from fp4rl.rl.config import TrainConfig
    from fp4rl.rl.rundir import RunDir


#: the preset ``fp4rl train`` runs without ``--config``: one that runs anywhere in minutes
DEFAULT_TRAIN_PRESET = "smoke"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``train`` command's options."""
    train = sub.add_parser("train", help="GRPO with FP4 rollout and FP4 training policies")
    train.add_argument("--config", help="config preset name (see fp4rl presets) or YAML file; "
                       f"default {DEFAULT_TRAIN_PRESET} (with --resume: the run's own)")
    train.add_argument("--help-config", action=_HelpConfig,
                       help="print every setting of the training config (default, type, "
                       "meaning) and exit")
    train.add_argument("--output", required=True, help="run directory")
    train.add_argument("--steps", type=positive_int, help="override run.steps")
    train.add_argument("--resume", action="store_true",
                       help="continue the run in --output from its latest checkpoint that "
                       "loads, with its saved settings (docs/training.md)")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. grpo.learning_rate=1e-5 (anywhere among "
                       "the options)")
    train.set_defaults(func=run)


class _HelpConfig(argparse.Action):
    """``--help-config``: like ``--help``, it prints and exits before any other option is
    required."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None,
                 **_: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(config_help())
        parser.exit()


def config_help() -> str:
    """Every setting of the training config, from its schema: ``key = default  (type)``
    and the meaning beneath, sections as headings."""
    from fp4rl.rl.config import config_fields

    lines = ["Settings of fp4rl train (YAML keys, or key=value overrides):"]
    for f in config_fields():
        if f.type == "section":
            lines += ["", f"{f.key}:  {f.description}"]
            continue
        lines.append(f"  {f.key} = {f.default}  ({f.type})")
        lines += textwrap.wrap(f.description, 88, initial_indent="      ",
                               subsequent_indent="      ")
    return "\n".join(lines)


def run(args: argparse.Namespace, console: Console) -> int:
    """One run; under torchrun / accelerate every process runs this, rank 0 speaks and
    writes the run's files."""
    from fp4rl.rl.distributed import launched_rank, teardown

    if launched_rank() != 0:
        console = Console(quiet=True)
    try:
        return _train_run(args, console, is_main=launched_rank() == 0)
    finally:
        teardown()


def _train_run(args: argparse.Namespace, console: Console, is_main: bool) -> int:
    from fp4rl.errors import DirectoryInUse
    from fp4rl.paths import check_writable
    from fp4rl.rl.rundir import RunDir
    from fp4rl.rundir_lock import exclusive

    run_dir = RunDir(Path(args.output))
    check_writable(run_dir.path, "--output", directory=True)
    # a mistake is refused before the directory is touched, lock file included
    cfg = _config(args, run_dir, console)
    created = not run_dir.path.exists()
    # one writer per run directory; under torchrun the ranks share rank 0's lock
    lock = exclusive(run_dir.path, warn=console.print) if is_main else contextlib.nullcontext()
    try:
        with lock:
            if not args.resume:
                run_dir.refuse_a_run()  # one that started between the check and the lock
            return _train_with(cfg, run_dir, args.resume, console, is_main)
    except BaseException as err:
        if created and is_main and not isinstance(err, DirectoryInUse):
            run_dir.remove_if_unstarted()
        raise


def _config(args: argparse.Namespace, run_dir: RunDir, console: Console) -> TrainConfig:
    """A new run's config (``--config``, default :data:`DEFAULT_TRAIN_PRESET`, with the
    overrides), refused where a run already is; or, with ``--resume``, the run's saved
    config with the overrides that cannot change its trajectory (``--config`` may be
    given again)."""
    from fp4rl.rl.config import load_config

    steps = {} if args.steps is None else {"run.steps": args.steps}
    if not args.resume:
        run_dir.refuse_a_run()
        return load_config(args.config or DEFAULT_TRAIN_PRESET, args.overrides, steps)
    if args.config is None:
        run_dir.saved_config()  # one line where there is no run to resume
    requested = load_config(args.config or run_dir.config_file, args.overrides, steps)
    return run_dir.resumable_config(requested, console.print)


def _train_with(cfg: TrainConfig, run_dir: RunDir, resume: bool, console: Console,
                is_main: bool) -> int:
    from fp4rl.progress import progress_bar
    from fp4rl.rl.report import mismatch_line, write_run_report
    from fp4rl.rl.trainer import Trainer

    trainer = Trainer.from_config(cfg, run_dir.path, log=console.print)
    if is_main:  # as run: device, precision, strategy; the contract of --resume
        run_dir.write_config(trainer.cfg)
    cfg = trainer.cfg
    with progress_bar(console) as bar:
        task = bar.add_task("GRPO", total=cfg.run.steps, completed=0, info="")

        def show(step: int, total: int, m: dict) -> None:
            bar.update(task, completed=step, info=f"reward {m['reward_mean']:.3f}  "
                       f"loss {m['loss']:+.4f}  len {m['completions/mean_length']:.0f}")

        try:
            trainer.train(resume=resume, progress=show)
        finally:
            trainer.close()
    if is_main:
        write_run_report(run_dir.path)
        console.print(f"metrics: {run_dir.metrics_file}  curves: {run_dir.path / 'curves.png'}")
        if line := mismatch_line(run_dir.path):
            console.print(line)
    return 0
