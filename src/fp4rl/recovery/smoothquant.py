"""SmoothQuant on the rollout: migrate activation range into the weights per channel.

``s_c = max|X_c|^a / max|W_c|^(1-a)``; the layer computes ``Q(X / s) Q(W * s)^T``.
The scales are calibrated from live activations: the first rollout forward after
:meth:`begin_step` (the prompts' prefill of a new RL step) sets them, later forwards of
that step reuse them. This is the paper's setting, and its weakness under RL's moving
activation statistics is what the paper reports.
"""

from __future__ import annotations

import torch
from pydantic import Field, field_validator

from fp4rl.errors import RecipeError
from fp4rl.gemm import Operand
from fp4rl.recovery.base import RecoveryConfig, RolloutRecovery, register_recovery

MIN_SCALE = 1e-5


class SmoothQuantConfig(RecoveryConfig):
    """alpha: migration strength, ``s = max|X|^alpha / max|W|^(1-alpha)``."""

    alpha: float = Field(0.5, description="migration strength: the share of the "
                         "activations' range moved into the weights")

    @field_validator("alpha")
    @classmethod
    def _a_share(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise RecipeError(f"rollout.recovery.alpha must be in [0, 1], got {value}")
        return value


class SmoothQuant(RolloutRecovery):
    config_cls = SmoothQuantConfig
    variants = (("", "SmoothQuant"),)
    config: SmoothQuantConfig
    reads_weight = True  # calibration reads it and its weight is rescaled

    def init_state(self) -> None:
        self.scales: torch.Tensor | None = None
        self._stale = True

    def begin_step(self) -> None:
        self._stale = True

    def prepare(self, x: torch.Tensor, w: torch.Tensor) -> None:
        if self._stale:
            self.calibrate(x, w)

    def calibrate(self, x: torch.Tensor, w: torch.Tensor) -> None:
        """Per input channel: ``s = max|X|^a / max|W|^(1-a)`` from this batch and the weight."""
        a = self.config.alpha
        x_max = x.detach().abs().amax(dim=0).float().clamp_min(MIN_SCALE)
        w_max = w.detach().abs().amax(dim=0).float().clamp_min(MIN_SCALE)
        self.scales = (x_max.pow(a) / w_max.pow(1 - a)).clamp_min(MIN_SCALE)
        self._stale = False
        self.version += 1

    def transform_weight(self, w: torch.Tensor) -> torch.Tensor:
        return w if self.scales is None else w * self.scales.to(w.device, w.dtype)

    def activation(self, x: torch.Tensor, dtype: torch.dtype) -> list[Operand]:
        assert self.scales is not None  # prepare() calibrates before any activation
        return [self.quantize_act(x / self.scales.to(device=x.device, dtype=x.dtype))]


register_recovery("smoothquant", SmoothQuant)
