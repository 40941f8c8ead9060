"""The rollout-recovery plug-in interface.

A recovery method decides how one patched linear layer computes its rollout output
from the high-precision input ``x`` (tokens x in_features), given the layer's
quantized weight. Each layer owns one method instance, so per-layer state
(SmoothQuant scales, Hadamard signs) lives there. A new method is one module: subclass
:class:`RolloutRecovery`, set ``name`` and register it with :func:`register`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from fp4rl.nn.gemm import Operand, mm, quantize_operand
from fp4rl.nn.recipe import Recovery


class RolloutRecovery(ABC):
    """Per-layer rollout-side treatment of activations (and, if needed, weights)."""

    name: ClassVar[str]

    def __init__(self, config: Recovery, act_format: str, in_features: int, seed: int) -> None:
        self.config = config
        self.act_format = act_format
        self.in_features = in_features
        self.seed = seed
        #: bumped whenever ``transform_weight`` would change: invalidates the weight cache
        self.version = 0

    def quantize_act(self, x: torch.Tensor) -> Operand:
        """Q(x) along the reduction axis in the rollout activation format."""
        return quantize_operand(x, self.act_format)

    def begin_step(self) -> None:  # noqa: B027  (optional hook)
        """Called at the start of every RL step (a new policy version)."""

    def prepare(self, x: torch.Tensor, w: torch.Tensor) -> None:  # noqa: B027  (optional hook)
        """Called before each rollout forward, before the quantized weight is fetched."""

    def state_dict(self) -> dict[str, object]:
        """State to checkpoint beyond the config (e.g. random generators)."""
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:  # noqa: B027  (optional)
        """Restore :meth:`state_dict`."""

    def transform_weight(self, w: torch.Tensor) -> torch.Tensor:
        """High-precision weight transform applied before weight quantization."""
        return w

    @abstractmethod
    def activation(self, x: torch.Tensor, dtype: torch.dtype) -> list[Operand]:
        """The activation operands that share the quantized weight in the rollout GEMM
        (one for plain FP4; ResQ's two terms where ``dtype`` cannot hold their sum)."""

    def forward(self, x: torch.Tensor, qw: Operand, w: torch.Tensor, dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """Rollout output in ``dtype``: ``x`` (tokens, in), ``qw`` the quantized weight,
        ``w`` the raw one."""
        return mm(self.activation(x, dtype), qw.t(), dtype, bias)


class NoRecovery(RolloutRecovery):
    """Plain FP4 rollout: ``Q(X) Q(W)^T``."""

    name = "none"

    def activation(self, x: torch.Tensor, dtype: torch.dtype) -> list[Operand]:
        return [self.quantize_act(x)]


_METHODS: dict[str, type[RolloutRecovery]] = {"none": NoRecovery}


def register(cls: type[RolloutRecovery]) -> type[RolloutRecovery]:
    """Class decorator adding a method to the registry under ``cls.name``."""
    _METHODS[cls.name] = cls
    return cls


def make_recovery(config: Recovery, act_format: str, in_features: int,
                  seed: int) -> RolloutRecovery:
    """Instantiate the configured method for one layer."""
    from fp4rl.recovery import occ, resq, rht, smoothquant  # noqa: F401  (registration)

    return _METHODS[config.method](config, act_format, in_features, seed)
