"""What every kernel module of :mod:`fp4rl.kernels` shares: the operations a kernel runs
(:class:`Operation`), what a format declares of its kernels (:class:`FormatKernels`) and
what the kernels read of a format (:class:`KernelFormat`).

A leaf: it imports no other kernel module but the codes (:mod:`.codes`), so the dispatch
(:mod:`.dispatch`) and the Triton and C modules it chooses between all import it, and none
imports the package back.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from fp4rl.kernels.codes import FormatCode


class Operation(StrEnum):
    """One operation a kernel backend runs for a format (a str, so a format's declaration
    reads as the names it has always had)."""

    ROWS = "rows"  # quantize along axis 1
    COLS = "cols"  # quantize along axis 0
    RESQ = "resq"  # the fused Rollout-ResQ pass
    RESQ_TERMS = "resq_terms"  # ResQ's two bf16 GEMM operands in one pass
    ROWS_BF16 = "rows_bf16"  # bf16 rows to their bf16 block values in one pass
    DECODE = "decode"  # packed codes to values
    PACKED_MM = "packed_mm"  # activations times a packed weight decoded in registers
    BOTH = "both"  # a matrix along its rows and along its columns from one read
    QMM = "qmm"  # a training GEMM quantizing its operands as it loads them


#: every operation, in declaration order
OPERATIONS: tuple[Operation, ...] = tuple(Operation)
QUANTIZE: frozenset[Operation] = frozenset({Operation.ROWS, Operation.COLS})
QUANTIZE_AND_RESQ: frozenset[Operation] = QUANTIZE | {Operation.RESQ, Operation.RESQ_TERMS}
#: the quantize operation along each axis of a matrix
AXIS_OPERATIONS: dict[int, Operation] = {0: Operation.COLS, 1: Operation.ROWS}

@dataclass(frozen=True)
class FormatKernels:
    """The compiled kernels of one format, declared by the format itself.

    ``code`` (a :class:`~fp4rl.kernels.codes.FormatCode`) selects the format's branch in
    quant.c and in the Triton kernels; ``c`` and ``triton`` are the :class:`Operation` s each
    backend runs for it. An operation a backend lacks is composed from others or taken by the
    reference path (NVFP4's per-tensor scale, say, needs a pass over the whole tensor
    before the C kernel's block pass). A format declared outside the package may name the
    operations by their strings: they are checked and turned into members here.
    """

    code: FormatCode
    c: frozenset[Operation] = frozenset()
    triton: frozenset[Operation] = frozenset()

    def __post_init__(self) -> None:
        names = {str(op) for op in self.c | self.triton}
        unknown = names - {str(op) for op in Operation}
        if unknown:
            raise ValueError(f"unknown kernel operations {sorted(unknown)}; "
                             f"known: {', '.join(OPERATIONS)}")
        object.__setattr__(self, "c", frozenset(Operation(op) for op in self.c))
        object.__setattr__(self, "triton", frozenset(Operation(op) for op in self.triton))


class KernelFormat(Protocol):
    """What the kernels read of a format object (:class:`fp4rl.formats.NumberFormat`).

    Read-only properties, so that the formats' ClassVars satisfy them."""

    @property
    def name(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def kernels(self) -> FormatKernels | None: ...
    @property
    def has_tensor_scale(self) -> bool: ...  # the kernels then read g on top of the blocks


__all__ = ["AXIS_OPERATIONS", "OPERATIONS", "QUANTIZE", "QUANTIZE_AND_RESQ",
           "FormatKernels", "KernelFormat", "Operation"]
