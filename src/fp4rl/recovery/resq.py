"""Rollout-ResQ: ``Y = Q(X) Q(W)^T + S(Q(X - Q(X))) Q(W)^T``.

The residual ``X - Q(X)`` holds what FP4 lost, chiefly the small values that an
outlier flushed to zero; quantizing it again recovers most of them, and the sparsity
function ``S`` keeps the second GEMM cheap on hardware (2:4 runs at half the dense cost).
Both GEMMs share ``Q(W)``, so simulation folds them into one matmul of
``Q(X) + S(Q(X - Q(X)))``; the two-GEMM form stays available for checking.
"""

from __future__ import annotations

from typing import ClassVar, cast

import torch
from pydantic import Field

from fp4rl.formats import BlockFormat, NumberFormat, get_format, quantize
from fp4rl.gemm import NMOperand, Operand, has_tensor_scale, quantize_operand
from fp4rl.kernels import has_nm_terms, resq_rows, resq_terms, resq_terms_nm
from fp4rl.recovery.base import RecoveryConfig, RolloutRecovery, register_recovery
from fp4rl.recovery.sparsity import (
    NM,
    Dense,
    Pattern,
    SparsityPattern,
    parse_pattern,
    sparsify,
)


def resq_activation(x: torch.Tensor, fmt: NumberFormat,
                    pattern: SparsityPattern) -> torch.Tensor:
    """``Q(x) + S(Q(x - Q(x)))``: the effective rollout activation of ResQ.

    Float32 inputs with a dense or n:m pattern take one fused kernel pass (bit-identical
    to the composed steps below, which every other case uses). The format and pattern are
    objects (:func:`resq_matmul`, the public form, reads their names).
    """
    fused = _fused(x, fmt, pattern)
    if fused is not None:
        return fused
    qx = quantize(x, fmt)
    return qx + sparsify(quantize(x - qx, fmt), pattern)


def _kernel_args(f: NumberFormat, pattern: SparsityPattern
                 ) -> tuple[BlockFormat, int, int] | None:
    """(format, keep, group) for the fused kernels (group 0: dense), or None where
    they do not apply (a non-block format, a channel or block pattern)."""
    if not isinstance(f, BlockFormat) or not isinstance(pattern, Dense | NM):
        return None
    if isinstance(pattern, NM) and pattern.n < pattern.m:
        return f, pattern.n, pattern.m
    return f, 0, 0  # dense, or n:n, which keeps every value


def _fused(x: torch.Tensor, fmt: NumberFormat, pattern: SparsityPattern
           ) -> torch.Tensor | None:
    args = _kernel_args(fmt, pattern)
    if args is None or x.dim() == 0:
        return None
    out = resq_rows(args[0], x.reshape(-1, x.shape[-1]), *args[1:])
    return None if out is None else out.reshape(x.shape)


def _fused_terms(x: torch.Tensor, fmt: NumberFormat,
                 pattern: SparsityPattern) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``Q(x)`` and ``S(Q(x - Q(x)))`` as bf16 rows from one kernel pass, where there is one."""
    args = _kernel_args(fmt, pattern)
    return None if args is None or x.dim() != 2 else resq_terms(args[0], x, *args[1:])


def resq_matmul(x: torch.Tensor, w: torch.Tensor, fmt: str | NumberFormat,
                pattern: str = "2:4", two_gemm: bool = False,
                weight_format: str | NumberFormat | None = None) -> torch.Tensor:
    """Rollout-ResQ linear (no bias): ``Q(x)Q(w)^T + S(Q(x - Q(x)))Q(w)^T``.

    ``x`` is (..., in), ``w`` (out, in); both are quantized along ``in``. ``weight_format``
    defaults to ``fmt``. ``two_gemm=True`` computes the two products separately, as
    hardware would; the default folds them into one matmul (equal up to summation order).
    """
    f, kept = get_format(fmt), parse_pattern(pattern)  # names read here, once
    qw = quantize(w, get_format(weight_format) if weight_format is not None else f)
    if not two_gemm:
        return resq_activation(x, f, kept) @ qw.t()
    qx = quantize(x, f)
    return qx @ qw.t() + sparsify(quantize(x - qx, f), kept) @ qw.t()


class ResQConfig(RecoveryConfig):
    """sparsity: the pattern ``S`` keeps of the residual: "dense", any "n:m" ("2:4"),
    "channel:<fraction>" or "block:<rows>x<cols>:<fraction>", parsed here, once."""

    sparsity: Pattern = Field("2:4", validate_default=True,
                              description="the pattern the residual keeps: dense, n:m "
                              "(2:4), channel:<fraction> or block:<rows>x<cols>:<fraction>")

    @classmethod
    def from_text(cls, arg: str) -> ResQConfig:
        return cls(sparsity=parse_pattern(arg or "dense"))

    def text(self) -> str:
        return str(self.sparsity)

    @property
    def patterns(self) -> tuple[SparsityPattern, ...]:
        return (self.sparsity,)


class ResQ(RolloutRecovery):
    config_cls = ResQConfig
    variants: ClassVar[tuple[tuple[str, str], ...]] = (
        ("dense", "ResQ (dense)"), ("channel:0.5", "ResQ (channel 0.5)"),
        ("block:32x64:0.5", "ResQ (block 32x64 0.5)"), ("2:4", "ResQ (2:4)"))
    serves_in_engines = True
    config: ResQConfig

    @property
    def pattern(self) -> SparsityPattern:
        """The sparsity pattern (parsed once, by the config)."""
        return self.config.sparsity

    def kernel_args(self) -> tuple[BlockFormat, int, int] | None:
        """(format, keep, group) where the fused kernels compute this method's terms
        (group 0: dense), else None (a format without blocks, a channel or block
        pattern)."""
        fmt = self.act_format
        return _kernel_args(fmt, self.pattern) if isinstance(fmt, NumberFormat) else None

    def activation_scales(self, dtype: torch.dtype) -> tuple[bool, ...]:
        if dtype == torch.float32 or not isinstance(self.act_format, NumberFormat):
            return (False,)  # one folded operand, its scale applied inside; or x itself
        scaled = has_tensor_scale(self.act_format)
        return (scaled, scaled)

    def activation(self, x: torch.Tensor, dtype: torch.dtype) -> list[Operand]:
        """One folded operand in fp32 (which holds the sum exactly); in bf16 the two
        terms stay apart, each exact, and share one read of ``Q(W)`` in ``mm``. Unquantized
        activations leave no residual: the operand is ``x``."""
        fmt = self.act_format
        if not isinstance(fmt, NumberFormat):
            return [self.quantize_act(x)]
        if dtype == torch.float32:
            return [Operand(resq_activation(x, fmt, self.pattern))]
        if dtype == torch.bfloat16:
            rows = x if x.dtype == torch.bfloat16 else x.float()  # bf16 is read as it is
            terms = _fused_terms(rows, fmt, self.pattern)
            if terms is not None:  # both bf16 operands from one kernel pass
                return [Operand(terms[0]), Operand(terms[1])]
        xf = x.float()
        qx = quantize_operand(x, fmt)
        fused = _fused(xf, fmt, self.pattern) if qx.scale is None else None
        if fused is not None:  # the fp32 sum is exact, so the difference is S(Q(x - Q(x)))
            return [qx, Operand(fused - qx.values)]
        residual = quantize_operand(xf - qx.dense(), fmt)
        return [qx, Operand(sparsify(residual.values, self.pattern), residual.scale)]

    def packed_nm(self, device: torch.device) -> tuple[int, int] | None:
        """(keep, group) of the n:m pattern where the ResQ kernel on ``device`` keeps the
        residual n:m sparse (a block format without a per-tensor scale, a group the kernel
        ranks, Triton: a GPU)."""
        args = self.kernel_args()
        if args is None or not args[2] or not has_nm_terms(args[0], device, args[2]):
            return None
        return args[1], args[2]

    def packed_activation(self, x: torch.Tensor, dtype: torch.dtype
                          ) -> list[Operand | NMOperand]:
        """In bf16, ``Q(x)`` and the residual kept n:m sparse, as sparse tensor cores take
        it, from one kernel pass (at 2:4 the pass writes and the packed GEMM reads 0.625x
        the residual's dense bf16 bytes); else :meth:`activation`'s operands."""
        nm = self.packed_nm(x.device) if dtype == torch.bfloat16 and x.dim() == 2 else None
        if nm is not None:
            rows = x if x.dtype == torch.bfloat16 else x.float()
            terms = resq_terms_nm(cast(BlockFormat, self.act_format), rows, *nm)
            if terms is not None:
                q, kept, bits = terms
                return [Operand(q), NMOperand(kept, bits, nm[0], nm[1], x.shape[1])]
        return list(self.activation(x, dtype))


register_recovery("resq", ResQ)
