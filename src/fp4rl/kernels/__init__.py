"""Fast paths behind the format functions: a fused C kernel on CPU, Triton on GPU.

The package's face: the names others use, re-exported from the modules that hold them.
:mod:`.base` the shared types (the operations, what a format declares of its kernels, what
the kernels read of a format), :mod:`.dispatch` which backend runs an operation for a format
on a device and the calls that run it, :mod:`.cpu` / :mod:`.cpu_ops` the C kernel,
``triton_*`` the Triton kernels, :mod:`.codes` the codes both branch on. Every fast path is
bit-identical to the reference in :mod:`fp4rl.formats`; a dispatch function returns None
(or False) where none applies and the caller takes the reference.
"""

from __future__ import annotations

from fp4rl.kernels.base import (
    OPERATIONS,
    QUANTIZE,
    QUANTIZE_AND_RESQ,
    FormatKernels,
    KernelFormat,
    Operation,
)
from fp4rl.kernels.dispatch import (
    RESQ_MAX_GROUP,
    decode_rows,
    finite_amax,
    has_kernel,
    has_matrix_kernel,
    has_nm_terms,
    has_packed_mm,
    has_qmm,
    kernel_choice,
    kernel_plan,
    packed_mm,
    qmm,
    quantize_both,
    quantize_matrix,
    quantize_matrix_values,
    quantize_on_load,
    quantize_rows,
    quantize_rows_bf16,
    resq_rows,
    resq_terms,
    resq_terms_nm,
    vector_amax,
    vector_amax_both,
)

__all__ = ["OPERATIONS", "QUANTIZE", "QUANTIZE_AND_RESQ", "RESQ_MAX_GROUP",
           "FormatKernels", "KernelFormat", "Operation", "decode_rows", "finite_amax", "has_kernel",
           "has_matrix_kernel", "has_nm_terms", "has_packed_mm", "has_qmm", "kernel_choice",
           "kernel_plan", "packed_mm", "qmm", "quantize_both", "quantize_matrix",
           "quantize_matrix_values", "quantize_on_load", "quantize_rows", "quantize_rows_bf16",
           "resq_rows", "resq_terms", "resq_terms_nm", "vector_amax", "vector_amax_both"]
