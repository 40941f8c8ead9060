"""Outlier clamping and compensation (OCC) on the rollout.

``X`` is clamped at a quantile of ``|X|`` (default 0.99) over the whole tensor, the
clamped tensor goes through the FP4 GEMM, and the clipped excess (non-zero only at
the outliers) is added back through a sparse high-precision matmul with the
unquantized weight. The global quantile is what makes OCC slow at scale.
"""

from __future__ import annotations

import torch

from fp4rl.recovery.base import RolloutRecovery, register
from fp4rl.recovery.outliers import clamp_outliers, residual_matmul


@register
class OCC(RolloutRecovery):
    name = "occ"

    def matmul(self, x: torch.Tensor, qw: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        clamped, outliers = clamp_outliers(x, self.config.quantile)
        return self.quantize_act(clamped) @ qw.t() + residual_matmul(outliers, w.to(x.dtype))
