"""``fp4rl train``: one GRPO run in a run directory, new or resumed, on one process or
under torchrun / accelerate."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from fp4rl.cli.options import positive_int
from fp4rl.paths import write_text_atomic

if TYPE_CHECKING:
    from fp4rl.rl.config import TrainConfig


#: the preset ``fp4rl train`` runs without ``--config``: one that runs anywhere in minutes
DEFAULT_TRAIN_PRESET = "smoke"


#: a run directory's settings as run: what ``--resume`` continues, and checks against
CONFIG_FILE = "config.yaml"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``train`` command's options."""
    train = sub.add_parser("train", help="GRPO with FP4 rollout and FP4 training policies")
    train.add_argument("--config", help="config preset name (see fp4rl presets) or YAML file; "
                       f"default {DEFAULT_TRAIN_PRESET} (with --resume: the run's own)")
    train.add_argument("--output", required=True, help="run directory")
    train.add_argument("--steps", type=positive_int, help="override run.steps")
    train.add_argument("--resume", action="store_true",
                       help="continue the run in --output from its latest checkpoint that "
                       "loads, with its saved settings (docs/training.md)")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. grpo.learning_rate=1e-5 (anywhere among "
                       "the options)")
    train.set_defaults(func=run)


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
    from fp4rl.paths import check_writable
    from fp4rl.rundir_lock import exclusive

    out = Path(args.output)
    check_writable(out, "--output", directory=True)
    # a mistake is refused before the directory is touched, lock file included
    cfg = _resume_config(args, out, console) if args.resume else _new_run_config(args, out)
    created = not out.exists()
    # one writer per run directory; under torchrun the ranks share rank 0's lock
    lock = exclusive(out, warn=console.print) if is_main else contextlib.nullcontext()
    try:
        with lock:
            if not args.resume:
                _refuse_a_run(out)  # one that started between the check and the lock
            return _train_with(cfg, out, args.resume, console, is_main)
    except BaseException as err:
        if created and is_main and not _refused_by_lock(err):
            _remove_unstarted(out)
        raise


def _refused_by_lock(err: BaseException) -> bool:
    """Whether ``err`` is a second writer's refusal (the directory is the holder's)."""
    from fp4rl.errors import OutputError

    return isinstance(err, OutputError) and " is in use by " in str(err)


def _train_with(cfg: TrainConfig, out: Path, resume: bool, console: Console,
                is_main: bool) -> int:
    from fp4rl.progress import progress_bar
    from fp4rl.rl.report import write_run_report
    from fp4rl.rl.trainer import Trainer

    trainer = Trainer.from_config(cfg, out, log=console.print)
    if is_main:  # as run: device, precision, strategy; the contract of --resume
        write_text_atomic(out / CONFIG_FILE, cfg_yaml(trainer.cfg))
    cfg = trainer.cfg
    with progress_bar(console) as bar:
        task = bar.add_task("GRPO", total=cfg.run.steps, completed=0, info="")

        def show(step: int, total: int, m: dict) -> None:
            bar.update(task, completed=step, info=f"reward {m['reward_mean']:.3f}  "
                       f"loss {m['loss']:+.4f}  len {m['completions/mean_length']:.0f}")

        trainer.train(resume=resume, progress=show)
    if is_main:
        write_run_report(out)
        console.print(f"metrics: {out / 'metrics.jsonl'}  curves: {out / 'curves.png'}")
    return 0


def _steps(args: argparse.Namespace) -> dict[str, int]:
    return {} if args.steps is None else {"run.steps": args.steps}


def _holds_run(out: Path) -> bool:
    from fp4rl.rl import checkpoint as ckpt
    from fp4rl.rl.trainer import METRICS

    return (out / METRICS).exists() or ckpt.latest_checkpoint(out) is not None


def _new_run_config(args: argparse.Namespace, out: Path) -> TrainConfig:
    """A new run's config: ``--config`` (default :data:`DEFAULT_TRAIN_PRESET`) with the
    overrides; refused where ``out`` already holds a run."""
    from fp4rl.rl.config import load_config

    _refuse_a_run(out)
    return load_config(args.config or DEFAULT_TRAIN_PRESET, args.overrides, _steps(args))


def _refuse_a_run(out: Path) -> None:
    from fp4rl.errors import OutputError

    if _holds_run(out):
        raise OutputError(f"{out} already holds a run: pass --resume to continue it, or "
                          "choose another --output")


def _resume_config(args: argparse.Namespace, out: Path, console: Console) -> TrainConfig:
    """The run's saved config, with the overrides that cannot change its trajectory
    (:data:`fp4rl.rl.config.RESUMABLE`); any other change is refused, listing the keys.
    ``--config`` may be given again: its ``auto`` settings mean what they resolved to."""
    from fp4rl.errors import ResumeError
    from fp4rl.rl.config import RESUMABLE, changed_settings, describe_changes, load_config

    saved_path = out / CONFIG_FILE
    if not saved_path.is_file():
        raise ResumeError(f"--resume: {out} holds no run to resume (no {CONFIG_FILE}); drop "
                          "--resume to start one there")
    saved = load_config(saved_path)
    requested = _resolved_like(load_config(args.config or saved_path, args.overrides,
                                           _steps(args)), saved)
    changed = changed_settings(saved, requested)
    if changed:
        raise ResumeError(f"--resume continues {out} with its saved settings ({saved_path}) "
                          f"and would change {describe_changes(changed)}; only "
                          f"{', '.join(RESUMABLE)} may change: start a new run under another "
                          "--output to try other settings")
    _check_checkpoints(out, console)
    return requested


def _check_checkpoints(out: Path, console: Console) -> None:
    """Say when a run has no checkpoint yet (it trains from step 0), and refuse one whose
    every checkpoint is damaged before loading any model; the trainer reports a damaged
    latest one as it falls back to the previous."""
    from fp4rl.errors import CheckpointError
    from fp4rl.rl import checkpoint as ckpt

    found = ckpt.complete_checkpoints(out)
    if not found:
        console.print(f"note: {out} has no checkpoint yet: training it from step 0")
    problems = []
    for path in found:
        try:
            ckpt.verify_checkpoint(path)
            return
        except CheckpointError as err:
            problems.append(str(err))
    if problems:
        raise CheckpointError(f"--resume: no checkpoint of {out} is intact: "
                              + "; ".join(problems))


def _resolved_like(requested: TrainConfig, saved: TrainConfig) -> TrainConfig:
    """``requested`` with each ``auto`` the trainer resolves (device, mixed precision,
    strategy) taken from ``saved``, which holds what it resolved to."""
    update: dict[str, object] = {key: getattr(saved, key) for key in ("device", "mixed_precision")
                                 if getattr(requested, key) == "auto"}
    if requested.distributed.strategy == "auto":
        update["distributed"] = requested.distributed.model_copy(
            update={"strategy": saved.distributed.strategy})
    return requested.model_copy(update=update)


def _remove_unstarted(out: Path) -> None:
    """Remove the run directory a failed or interrupted command created, unless a step
    finished in it: an empty run directory only blocks the next attempt's name."""
    import shutil

    if not _holds_run(out):
        shutil.rmtree(out, ignore_errors=True)


def cfg_yaml(cfg: object) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)  # type: ignore[attr-defined]
