"""The ``fp4rl`` command line: the parser assembled from one module per command, and the
error boundary (a user's mistake is one line and exit status 2, Ctrl-C one line and 130;
``--debug`` shows the traceback, a bug always does)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from rich.console import Console

from fp4rl.cli import (
    bench,
    cost,
    demo,
    diagnose,
    env,
    evaluate,
    experiment,
    export,
    fidelity,
    presets,
    train,
)
from fp4rl.errors import UserError
from fp4rl.host_memory import keep_freed_memory
from fp4rl.version import __version__

#: the commands, in ``fp4rl --help`` order: each module adds its parser and runs it
COMMANDS = (demo, train, presets, evaluate, export, diagnose, fidelity, cost, experiment, env,
            bench)


class UsageError(UserError):
    """A malformed command line, reported by :func:`main` in one line."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line (exit 2 through :func:`main`), not a usage
    block; ``--help`` still shows the usage."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fp4rl", description="fp4rl: end-to-end 4-bit RL post-training of "
                     "LLMs (FP4 rollout and FP4 training policies, Rollout-ResQ).")
    parser.add_argument("--version", action="version", version=f"fp4rl {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line as a namespace; ``train``'s overrides may stand anywhere among
    its options (argparse takes only the first run of positionals)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":
        args.overrides += [a for a in extra if not a.startswith("-")]
        extra = [a for a in extra if a.startswith("-")]
    if extra:
        raise UsageError(f"fp4rl {args.command}", f"unrecognized arguments: {' '.join(extra)}")
    args.argv = argv
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command. Whatever a user can cause (a value, a path, a file's contents, a
    damaged checkpoint) is one line on stderr and exit status 2; Ctrl-C is one line and
    130. ``--debug`` shows the traceback instead; a bug always does."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    args = None
    keep_freed_memory()  # a step's freed buffers stay for the next (fp4rl.host_memory)
    try:
        args = parse([a for a in argv if a != "--debug"])
        return args.func(args, Console())
    except (UserError, OSError) as err:
        if debug:
            raise
        _say(err.prog if isinstance(err, UsageError) else _prog(args), _message(err))
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        _say(_prog(args), _interrupted(args))
        return 130


def _prog(args: argparse.Namespace | None) -> str:
    return "fp4rl" if args is None else f"fp4rl {args.command}"


def _say(prog: str, message: str) -> None:
    """One line on stderr, whatever the message holds, naming the command."""
    print(f"{prog}: {' '.join(message.split())}", file=sys.stderr)


def _message(err: Exception) -> str:
    """A user error's message, or an operating-system error (a full disk, a file that
    vanished, a permission) as the file and what went wrong."""
    if isinstance(err, UsageError):
        return f"error: {err} (see {err.prog} --help)"
    if isinstance(err, OSError) and err.strerror:
        where = f"{err.filename}: " if err.filename else ""
        return f"error: {where}{err.strerror}"
    return f"error: {err}"


def _interrupted(args: argparse.Namespace | None) -> str:
    """What an interrupted command leaves: for training, the checkpoint it resumes from."""
    if args is None or args.command != "train":
        return "interrupted" + (": rerun the same command to resume" if args is not None
                                and args.command == "experiment" else "")
    from fp4rl.rl import checkpoint as ckpt

    found = ckpt.latest_checkpoint(Path(args.output))
    if found is None:
        return f"interrupted before the first checkpoint of {args.output}: nothing to resume"
    return (f"interrupted; {found} is the latest checkpoint: continue with fp4rl train "
            f"--output {args.output} --resume")
