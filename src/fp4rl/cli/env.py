"""``fp4rl env``: versions, devices and kernels, for a bug report."""

from __future__ import annotations

import argparse

from rich.console import Console

from fp4rl.paths import write_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``env`` command's options."""
    envp = sub.add_parser("env", help="versions, devices and kernels, for a bug report")
    envp.add_argument("--json", help="also write the report to this JSON file")
    envp.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from fp4rl import env

    sections = env.report()
    console.print(env.render(sections), markup=False, highlight=False, soft_wrap=True)
    if args.json:
        write_json(args.json, sections)
    return 0
