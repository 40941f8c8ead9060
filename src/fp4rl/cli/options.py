"""Options and checks shared by the commands: argparse types that refuse a bad value in
one line, the device and precision options (defined once), and the writability check
every command runs before its work."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

from rich.console import Console


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = f"int_at_least_{low}"
    return parse


#: an argparse type: an integer >= 1 (a count, a size, a number of steps)
positive_int = int_at_least(1)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a temperature, a speed-up)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_device_option(parser: argparse.ArgumentParser, default: str = "auto",
                      extra: str = "") -> None:
    """``--device``: auto (CUDA when available), cpu, cuda or cuda:N."""
    parser.add_argument("--device", default=default,
                        help=f"auto (cuda when available), cpu, cuda or cuda:N{extra}; "
                        f"default {default}")


def add_device_options(parser: argparse.ArgumentParser, precision: str) -> None:
    """``--device`` and ``--mixed-precision`` (the compute dtype), for the commands that
    run a model's forward in the run's precision."""
    add_device_option(parser)
    parser.add_argument("--mixed-precision", default=precision, choices=["no", "bf16", "auto"],
                        help=f"compute dtype: no (fp32), bf16, auto (bf16 where native); "
                        f"default {precision}")


def check_outputs(**paths: str | None) -> None:
    """Refuse, before any work, an ``--output`` directory or a ``--json``/``--plot`` file
    that could not be written (the work would be lost at the end)."""
    from fp4rl.paths import check_writable

    for option, path in paths.items():
        if path:
            check_writable(path, f"--{option}", directory=option == "output")


def track(items: Iterable, description: str, console: Console) -> Iterable:
    """A progress bar over ``items`` (rich)."""
    from rich.progress import track as rich_track

    return rich_track(items, description=description, console=console, transient=True)


def torch_gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()
