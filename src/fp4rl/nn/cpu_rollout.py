"""One FP4 layer's rollout GEMM on a CPU, its kernels chosen once per weight version.

A decode step of a small model calls every linear with a few rows. The general rollout
path (the recovery method's activation operands, then :func:`fp4rl.gemm.mm`) chooses its
kernels anew at every call: the format's backend, Triton or not, the operands' stacking,
the GEMM's order, each behind a few Python calls. On SmolLM2-135M at 8 rows that came to
about as much time again as the kernels themselves, so a rollout spent a quarter of its
time choosing. :class:`CpuRollout` holds what those choices came to for the two rollouts
fp4rl's recipes and benches run most: plain FP4 activations and Rollout-ResQ (dense or
n:m), in a block format without a per-tensor scale, bf16 compute, fp4rl's C kernels, the
weight kept for its version. It calls the same kernels in the same order as the general
path, so the bits are the same (``tests/nn/test_cpu_rollout.py`` compares the two on
every policy it takes); anything else, or a call the kernels may not take directly (a
compiled graph, a dispatch mode that must see the operators, a gradient), takes the
general path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fp4rl.formats import NumberFormat
from fp4rl.gemm import Operand, fixed_order, has_tensor_scale
from fp4rl.kernels import cpu, cpu_ops
from fp4rl.kernels.base import Operation
from fp4rl.kernels.dispatch import backend_is_c, resq_is_c, triton_for
from fp4rl.recovery import RolloutRecovery
from fp4rl.recovery.base import NoRecovery
from fp4rl.recovery.resq import ResQ


@dataclass(frozen=True, eq=False)
class CpuRollout:
    """``activation(x) @ Q(W)^T (+ bias)`` in bf16 for one layer and weight version:
    ``terms`` None for plain FP4 activations, ``(keep, group)`` for ResQ's two terms
    (group 0: dense). The bias is the layer's at each call (the weight's version key
    does not follow it)."""

    code: int
    weight: torch.Tensor = field(repr=False)  # Q(W)^T, bf16, as the GEMM reads it
    terms: tuple[int, int] | None = None

    @classmethod
    def of(cls, recovery: RolloutRecovery, qw: Operand, dtype: torch.dtype
           ) -> CpuRollout | None:
        """The plan for a layer with this recovery and rollout weight, or None where the
        general path must run (another method, a per-tensor scale, no C kernel, not
        bf16 compute, not a CPU)."""
        fmt = recovery.act_format
        if dtype != torch.bfloat16 or qw.scale is not None or qw.values.dtype != dtype or \
                qw.values.device.type != "cpu" or not isinstance(fmt, NumberFormat) or \
                has_tensor_scale(fmt) or fmt.kernels is None or \
                type(recovery).prepare is not RolloutRecovery.prepare:
            return None
        code = int(fmt.kernels.code)
        weight = qw.values.t()
        if type(recovery) is NoRecovery:
            if not all(backend_is_c(fmt, op) for op in (Operation.ROWS_BF16, Operation.BOTH)):
                return None
            return cls(code, weight)
        if type(recovery) is ResQ:
            assert isinstance(recovery, ResQ)
            args = recovery.kernel_args()
            if args is None or not resq_is_c(fmt, Operation.RESQ_TERMS, args[2]):
                return None
            return cls(code, weight, (args[1], args[2]))
        return None

    def takes(self, x2: torch.Tensor) -> bool:
        """Whether this call may run here: float32 or bf16 rows on the CPU, in eager
        mode, with no dispatch mode that must see the operators, needing no gradient, and
        the C kernels still chosen (``FP4RL_KERNELS`` and ``FP4RL_DISABLE_KERNELS`` are
        read at every call, as the general path reads them)."""
        return x2.dtype in (torch.float32, torch.bfloat16) and x2.device.type == "cpu" and \
            x2.dim() == 2 and x2.numel() > 0 and cpu_ops._direct(x2) and \
            triton_for(x2.device) is None and cpu_ops.available()

    def __call__(self, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x2.contiguous()
        if self.terms is None:
            # Q(x) in bf16: the bf16 kernel where x is bf16, else the values kernel
            # (the float32 fake-quantized values cast, bit for bit)
            if rows.dtype == torch.bfloat16:
                qx = cpu.quantize_bf16_cpu(self.code, rows)
            else:
                out = cpu.quantize_values_cpu(self.code, rows, True, False, None,
                                              torch.bfloat16)
                qx = None if out is None else out[0]
            assert qx is not None  # takes() checked the library
            if bias is None:
                return qx @ self.weight
            return torch.addmm(bias.to(torch.bfloat16), qx, self.weight)
        n = rows.shape[0]
        keep, group = self.terms
        stacked = cpu.resq_terms_cpu(self.code, rows, keep, group)  # Q(x) over S(...)
        assert stacked is not None
        chunk = cpu.BI_CHUNK if fixed_order() else cpu.BI_NO_RUNS
        products = cpu.bi_gemm(stacked, self.weight, out_dtype=torch.float32, chunk=chunk)
        y = products[:n].add_(products[n:])  # the two terms' fp32 products, then one rounding
        if bias is not None:
            y.add_(bias.float())
        return y.to(torch.bfloat16)
