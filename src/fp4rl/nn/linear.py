"""The FP4 linear layer: one module, two policies.

In **train** mode all three GEMMs are quantized along their own reduction axes, each
operand re-quantized from high precision (master weights stay FP32)::

    forward          Y  = Q_a(X) Q_w(W)^T          (along in_features)
    input gradient   dX = Q_g(dY) Q_w(W)           (along out_features)
    weight gradient  dW = Q_g(dY)^T Q_a(X)         (along tokens)

In **rollout** mode the forward runs the rollout recipe: the weight quantized once per
weight version (cached; an optimizer step bumps the parameter's version and so
invalidates it) and the activations through the configured recovery method.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import torch
from torch import nn

from fp4rl.formats import quantize
from fp4rl.nn.recipe import Recipe, TrainPrecision
from fp4rl.recovery.base import RolloutRecovery, make_recovery


class Mode(StrEnum):
    TRAIN = "train"
    ROLLOUT = "rollout"


def _q(x: torch.Tensor, fmt: str, dim: int, stochastic: bool = False) -> torch.Tensor:
    return quantize(x, fmt, dim=dim, rounding="stochastic" if stochastic else "nearest")


class _FP4LinearFn(torch.autograd.Function):
    """Autograd of ``Y = Q(X) Q(W)^T + b`` with quantized backward GEMMs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                precision: TrainPrecision) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        w = weight.to(x.dtype)
        y = _q(x2, precision.activations, -1) @ _q(w, precision.weights, -1).t()
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x2, weight)
        ctx.precision = precision
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        p: TrainPrecision = ctx.precision
        g = grad_y.reshape(-1, grad_y.shape[-1]).to(x2.dtype)
        w = weight.to(x2.dtype)
        sr = p.stochastic_gradients
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (_q(g, p.gradients, -1, sr) @ _q(w, p.weights, 0)).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = (_q(g, p.gradients, 0, sr).t() @ _q(x2, p.activations, 0))
            grad_w = grad_w.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(dim=0)
        return grad_x, grad_w, grad_b, None


class FP4Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in simulated 4-bit formats.

    Built from an existing linear with :meth:`from_linear`, sharing its parameters, so
    parameter names, the state_dict and optimizer references stay unchanged.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: Recipe | None = None, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self._init_policy(recipe or Recipe(), seed)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe, seed: int = 0) -> FP4Linear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_policy(recipe, seed)
        return new

    def _init_policy(self, recipe: Recipe, seed: int) -> None:
        self.mode = Mode.TRAIN
        self.seed = seed
        self.set_recipe(recipe)

    def set_recipe(self, recipe: Recipe) -> None:
        """Switch formats/recovery; drops cached rollout weights."""
        self.recipe = recipe
        self.recovery: RolloutRecovery = make_recovery(
            recipe.rollout.recovery, recipe.rollout.activations, self.in_features, self.seed)
        self._weight_cache: tuple[tuple[int, int, int], torch.Tensor] | None = None

    def begin_step(self) -> None:
        """Start of an RL step: recovery methods recalibrate / redraw as configured."""
        self.recovery.begin_step()

    def rollout_weight(self) -> torch.Tensor:
        """The rollout-quantized weight, recomputed only when the weight or recovery changed."""
        key = (self.weight._version, self.weight.data_ptr(), self.recovery.version)
        if self._weight_cache is None or self._weight_cache[0] != key:
            with torch.no_grad():
                w = self.recovery.transform_weight(self.weight.detach())
                qw = _q(w, self.recipe.rollout.weights, -1)
            self._weight_cache = (key, qw)
        return self._weight_cache[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode is Mode.TRAIN:
            return _FP4LinearFn.apply(x, self.weight, self.bias, self.recipe.train)
        return self._rollout_forward(x)

    @torch.no_grad()
    def _rollout_forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        w = self.weight.detach()
        self.recovery.prepare(x2, w)
        y = self.recovery.matmul(x2, self.rollout_weight().to(x.dtype), w)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        r, t = self.recipe.rollout, self.recipe.train
        rec = f"+{r.recovery.label}" if r.recovery.label else ""
        return (f"{super().extra_repr()}, mode={self.mode.value}, "
                f"train=W:{t.weights}/A:{t.activations}/G:{t.gradients}, "
                f"rollout=W:{r.weights}/A:{r.activations}{rec}")
