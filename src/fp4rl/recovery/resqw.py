"""Rollout-ResQ on both operands (beyond the paper): a sparse residual for the weight too.

Rollout-ResQ repairs the activation side, ``X_eff = Q(X) + S(Q(X - Q(X)))``. On a small
model the weight's own quantization error is then the larger one (measured on
SmolLM2-135M: teacher-forced KL to the unquantized policy about 0.26 from HiF4 weights
alone, against 0.03 for the activation error left by ResQ). This method applies the same
construction to the weight::

    W_eff = Q(W) + S_w(Q(W - Q(W)))          (in the rollout weight format)
    Y     = X_eff W_eff^T = X_eff Q(W)^T + X_eff S_w(Q(W - Q(W)))^T

The weight residual is computed once per weight version (once per RL step) and cached;
on hardware it is a third, sparse FP4 GEMM (2:4: half a dense FP4 GEMM), so the rollout
costs ``1/2 + 1/4 + 1/4 = 1`` mdn effective FLOPs against ResQ-2:4's ``3/4`` and BF16's
2 (the paper's cost model, FP4 at 4x FP16). The rollout engine needs the residual codes
besides ``Q(W)``, so the method reads the high-precision weight (``reads_weight``).
"""

from __future__ import annotations

import torch
from pydantic import Field

from fp4rl.gemm import Operand, mm, quantize_operand
from fp4rl.recovery.base import register_recovery
from fp4rl.recovery.resq import ResQ, ResQConfig
from fp4rl.recovery.sparsity import Pattern, SparsityPattern, parse_pattern, sparsify


class ResQWConfig(ResQConfig):
    """sparsity: the activation residual's pattern (as ResQ); weight_sparsity: the weight
    residual's pattern, along in_features ("dense", "n:m", ...)."""

    weight_sparsity: Pattern = Field("2:4", validate_default=True,
                                     description="the weight residual's pattern along "
                                     "in_features, as sparsity")

    @classmethod
    def from_text(cls, arg: str) -> ResQWConfig:
        """``resqw-2:4``: the same pattern for both residuals."""
        pattern = parse_pattern(arg or "dense")
        return cls(sparsity=pattern, weight_sparsity=pattern)

    @property
    def patterns(self) -> tuple[SparsityPattern, ...]:
        return (self.sparsity, self.weight_sparsity)


class ResQW(ResQ):
    config_cls = ResQWConfig
    variants = (("2:4", "ResQ-W (2:4, weights too)"),)
    config: ResQWConfig
    reads_weight = True  # the weight residual is computed from the high-precision weight
    serves_in_engines = False  # its weight residual is a second GEMM operand vLLM lacks

    def init_state(self) -> None:
        #: the residual of one ``Q(W)`` operand (held, so its identity is not reused)
        self._residual: tuple[Operand, torch.dtype, Operand] | None = None

    @property
    def weight_pattern(self) -> SparsityPattern:
        return self.config.weight_sparsity

    def weight_residual(self, w: torch.Tensor, qw: Operand, dtype: torch.dtype) -> Operand:
        """``S_w(Q(W - Q(W)))`` in ``dtype`` (exact), kept as long as ``qw`` is the operand
        the layer passes: the layer's kept ``Q(W)`` (:func:`fp4rl.nn.weight_cache`) is one
        object per weight version, and outside a scope each forward passes a new one, so
        the residual is never older than the ``Q(W)`` it corrects."""
        if self._residual is None or self._residual[0] is not qw or self._residual[1] != dtype:
            r = quantize_operand(w.float() - qw.dense().float(), self.weight_format)
            self._residual = (qw, dtype, Operand(sparsify(r.values, self.weight_pattern),
                                                 r.scale).to(dtype))
        return self._residual[2]

    def forward(self, x: torch.Tensor, qw: Operand, w: torch.Tensor, dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        acts = self.activation(x, dtype)
        rw = self.weight_residual(w, qw, dtype)
        if dtype == torch.float32:  # fp32 holds Q(W) + residual exactly: one GEMM
            return mm(acts, Operand(qw.dense() + rw.dense()).t(), dtype, bias)
        main = mm(acts, qw.t(), dtype, bias).float()
        return (main + mm(acts, rw.t(), dtype).float()).to(dtype)


register_recovery("resqw", ResQW)
