"""``fp4rl presets``: the config presets ``--config NAME`` accepts."""

from __future__ import annotations

import argparse

from rich.console import Console


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``presets`` command's options."""
    presets = sub.add_parser("presets", help="the config presets --config NAME accepts")
    presets.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.presets import list_presets

    presets = list_presets()
    width = max(map(len, presets))
    for name, description in presets.items():
        console.print(f"{name:<{width}}  {description}", markup=False, highlight=False,
                      soft_wrap=True)
    return 0
