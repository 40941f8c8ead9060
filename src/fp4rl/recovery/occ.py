"""Outlier clamping and compensation (OCC) on the rollout.

``X`` is clamped at a quantile of ``|X|`` (default 0.99) over the whole tensor, the
clamped tensor goes through the FP4 GEMM, and the clipped excess (non-zero only at
the outliers) is added back through a sparse high-precision matmul with the
unquantized weight. The global quantile is what makes OCC slow at scale.
"""

from __future__ import annotations

import torch
from pydantic import Field, field_validator

from fp4rl.errors import RecipeError
from fp4rl.gemm import Operand, mm
from fp4rl.recovery.base import RecoveryConfig, RolloutRecovery, register_recovery
from fp4rl.recovery.outliers import clamp_outliers, residual_matmul


class OCCConfig(RecoveryConfig):
    """quantile: the clamping quantile of ``|X|``; the clipped excess takes the sparse
    high-precision GEMM."""

    quantile: float = Field(0.99, description="the quantile of |X| (over the whole "
                            "tensor) it clamps at; the clipped excess takes a sparse "
                            "high-precision GEMM")

    @field_validator("quantile")
    @classmethod
    def _inside(cls, value: float) -> float:
        if not 0.0 < value < 1.0:
            raise RecipeError(f"rollout.recovery.quantile must be in (0, 1), got {value}")
        return value


class OCC(RolloutRecovery):
    config_cls = OCCConfig
    variants = (("", "OCC"),)
    config: OCCConfig
    reads_weight = True  # the clipped outliers multiply the high-precision weight

    def activation(self, x: torch.Tensor, dtype: torch.dtype) -> list[Operand]:
        return [self.quantize_act(clamp_outliers(x, self.config.quantile)[0])]

    def forward(self, x: torch.Tensor, qw: Operand, w: torch.Tensor, dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """The FP4 GEMM of the clamped input plus the outliers' sparse GEMM with the
        unquantized weight, both in ``dtype``."""
        clamped, outliers = clamp_outliers(x, self.config.quantile)
        y = mm(self.quantize_act(clamped), qw.t(), dtype, bias)
        return y + residual_matmul(outliers.to(dtype), w.to(dtype))


register_recovery("occ", OCC)
