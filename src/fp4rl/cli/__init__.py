"""The ``fp4rl`` command: :mod:`fp4rl.cli.app` holds ``main`` and the error boundary; each
command is one module (``train``, ``evaluate`` for ``fp4rl eval``, ``export``, ...) with
``add_parser(sub)`` and ``run(args, console)``; :mod:`fp4rl.cli.options` the options they
share."""

from fp4rl.cli.app import build_parser, main, parse
from fp4rl.cli.train import DEFAULT_TRAIN_PRESET

__all__ = ["DEFAULT_TRAIN_PRESET", "build_parser", "main", "parse"]
