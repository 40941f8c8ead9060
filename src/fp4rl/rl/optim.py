"""The optimizer of a run, built by name from the config.

Any ``torch.optim`` optimizer class works (``AdamW`` by default, as in TRL and verl);
it always steps the FP32 master weights, so its state is FP32 too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fp4rl.errors import ConfigError, did_you_mean
from fp4rl.rl.config import TrainConfig


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """``torch.optim``'s optimizer classes by lower-case name."""
    return {name.lower(): cls for name, cls in vars(torch.optim).items()
            if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
            and cls is not torch.optim.Optimizer}


def build_optimizer(params: Iterable[torch.nn.Parameter],
                    config: TrainConfig) -> torch.optim.Optimizer:
    """``optimizer.name`` over ``params`` with ``grpo.learning_rate``,
    ``grpo.weight_decay`` and ``optimizer.kwargs``; a bad name or argument is one line."""
    classes = optimizer_classes()
    name = config.optimizer.name
    cls = classes.get(name.lower())
    if cls is None:
        names = sorted(c.__name__ for c in classes.values())
        raise ConfigError(f"optimizer.name: {name!r} is not a torch.optim optimizer"
                          f"{did_you_mean(name, names)}; choose one of {', '.join(names)}")
    kwargs: dict[str, Any] = {"lr": config.grpo.learning_rate,
                              "weight_decay": config.grpo.weight_decay,
              **config.optimizer.kwargs}
    try:
        return cls(list(params), **kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"optimizer {cls.__name__} with {kwargs}: {err}") from None


__all__ = ["build_optimizer", "optimizer_classes"]
