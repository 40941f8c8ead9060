"""The kernel dispatch: for a format and a device, which backend runs an operation (the
fused C kernel on CPU, Triton on GPU, or none), and the calls that run it.

Every fast path is bit-identical to the float64 reference in :mod:`fp4rl.formats`;
the functions here return None (or False) where no fast path applies, and the caller
then uses the reference (which runs on any device). Each format object owns its kernels:
its ``kernels`` attribute (a :class:`~fp4rl.kernels.base.FormatKernels`, or None) names the
code both kernel sources branch on and the operations each backend runs for it, so a format
registered from outside the package simply has none. CUDA tensors take the Triton kernels;
``FP4RL_KERNELS=triton`` sends CPU tensors there too, which with ``TRITON_INTERPRET=1``
runs them through Triton's interpreter (how they are tested without a GPU).
``FP4RL_DISABLE_KERNELS=1`` turns every fast path off.

The Triton modules are imported here, where they are chosen, and only when they are: a
machine without Triton imports this module, and they import only :mod:`.base` (never the
package face), so no arrow runs back up. :func:`triton_for` is the one place the choice of
Triton is made; a caller that records what a GPU would launch (``fp4rl bench --traffic``)
patches it on this module.
"""

from __future__ import annotations

import os
import warnings
from functools import cache
from types import ModuleType

import torch

from fp4rl.kernels import cpu, cpu_ops
from fp4rl.kernels.base import AXIS_OPERATIONS, OPERATIONS, KernelFormat, Operation

#: largest n:m group the fused CPU path handles
RESQ_MAX_GROUP = 64


@cache
def _triton() -> ModuleType | None:
    try:  # the launchers as custom operators (triton_ops stands in for triton_quant)
        from fp4rl.kernels import triton_ops
    except ImportError as err:  # no triton wheel for this platform
        warnings.warn(f"fp4rl: Triton kernels unavailable, using the reference path ({err})",
                      RuntimeWarning, stacklevel=3)
        return None
    return triton_ops


def triton_for(device: torch.device) -> ModuleType | None:
    """The Triton kernel module if tensors on ``device`` should use it (and it imports)."""
    if os.environ.get("FP4RL_DISABLE_KERNELS") == "1":
        return None
    if device.type == "cuda" or os.environ.get("FP4RL_KERNELS") == "triton":
        return _triton()
    return None


def _backend(fmt: KernelFormat, device: torch.device, op: Operation) -> ModuleType | None:
    """The kernel module that runs ``op`` for ``fmt`` on ``device`` (``triton_ops`` or
    ``cpu``), or None. Where Triton is chosen it is the only candidate."""
    support = fmt.kernels
    if support is None:
        return None
    tri = triton_for(device)
    if tri is not None:
        return tri if op in support.triton else None
    if device.type == "cpu" and op in support.c and cpu_ops.available():
        return cpu
    return None


def backend_is_c(fmt: KernelFormat, op: Operation) -> bool:
    """Whether the C kernel runs ``op`` for ``fmt`` on CPU tensors, as chosen now."""
    return _backend(fmt, torch.device("cpu"), op) is cpu


def kernel_choice(fmt: KernelFormat, device: torch.device | str) -> tuple[str, str]:
    """Which path quantizes ``fmt``'s rows on ``device`` (``"c"``, ``"triton"`` or
    ``"reference"``) and why, for ``fp4rl env`` and bug reports."""
    device = torch.device(device)
    if os.environ.get("FP4RL_DISABLE_KERNELS") == "1":
        return "reference", "FP4RL_DISABLE_KERNELS=1"
    if fmt.kernels is None:
        return "reference", "no kernel knows this format"
    if device.type == "cuda" or os.environ.get("FP4RL_KERNELS") == "triton":
        why = "CUDA tensor" if device.type == "cuda" else "FP4RL_KERNELS=triton"
        if _triton() is None:
            return "reference", f"{why}, but Triton does not import"
        return "triton", why
    if device.type != "cpu":
        return "reference", f"no kernel for {device.type} tensors"
    if cpu.load_library() is None:
        return "reference", "the C kernel could not be compiled (no C compiler?)"
    return "c", f"fused C kernel, {cpu._library_path().name}"


def kernel_plan(fmt: KernelFormat, device: torch.device | str) -> dict[Operation, str]:
    """For each operation (:data:`OPERATIONS`), which backend runs it for ``fmt`` on
    ``device``: ``"c"``, ``"triton"``, or ``"none"`` where no kernel does (the caller
    then composes other operations, or takes the reference path)."""
    device = torch.device(device)
    names = {None: "none", cpu: "c"}
    return {op: names.get(_backend(fmt, device, op), "triton") for op in OPERATIONS}


def has_kernel(fmt: KernelFormat, device: torch.device | str, axis: int = 1) -> bool:
    """Whether a kernel quantizes ``fmt`` along ``axis`` (1: rows, 0: columns) of a
    matrix on ``device``; False for formats the kernels do not know."""
    if axis not in AXIS_OPERATIONS:
        raise ValueError(f"axis must be 0 or 1, got {axis}")
    return _backend(fmt, torch.device(device), AXIS_OPERATIONS[axis]) is not None


def has_matrix_kernel(fmt: KernelFormat, x: torch.Tensor) -> bool:
    """Whether :func:`quantize_matrix` runs for ``fmt`` on ``x``'s device, whichever
    axis it is asked for (a transposed view may flip the axis the kernel sees)."""
    return all(has_kernel(fmt, x.device, axis) for axis in AXIS_OPERATIONS)


def quantize_rows(fmt: KernelFormat, rows: torch.Tensor, noise: torch.Tensor | None,
                  tensor_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Fake-quantize contiguous float32 ``(R, L)`` rows along L, or None if no fast path.

    ``tensor_scale`` g (NVFP4's per-tensor scale, a 0-dim float32 tensor on the rows'
    device, or one per row, ``(R, 1)``) quantizes ``rows / g`` and returns the result
    times g, both steps in float32. The Triton kernels read g on the device; only the C
    kernel takes it as a number.
    """
    kernels = _backend(fmt, rows.device, Operation.ROWS)
    if kernels is None:
        return None
    if noise is not None:
        noise = noise.contiguous()
    if kernels is cpu:
        return _quantize_cpu(fmt, rows, noise, tensor_scale, 1)
    return kernels.quantize_2d(fmt, rows, 1, noise, tensor_scale)


def quantize_matrix(fmt: KernelFormat, x: torch.Tensor, axis: int, noise: torch.Tensor | None,
                    tensor_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Fake-quantize a float matrix along ``axis`` without a transposed copy (Triton: in
    ``x``'s dtype, read and written once; C: in float32), or None
    where :func:`has_matrix_kernel` is False (check it first: the caller's random draws
    depend on the path). ``noise`` is laid out as rows along ``axis``."""
    if not has_matrix_kernel(fmt, x):
        return None
    if noise is not None:
        noise = noise.contiguous()
    tri = triton_for(x.device)
    if tri is not None:  # reads bf16 and fp16 as they are, writes x's dtype
        return tri.quantize_2d(fmt, x, axis, noise, tensor_scale)
    x = x.float()
    flipped = not x.is_contiguous() and x.t().is_contiguous()  # a transposed view
    if flipped:
        x, axis = x.t(), 1 - axis
        tensor_scale = None if tensor_scale is None else tensor_scale.t()
    out = _quantize_cpu(fmt, x.contiguous(), noise, tensor_scale, axis)
    return out.t() if flipped and out is not None else out


def _quantize_cpu(fmt: KernelFormat, x: torch.Tensor, noise: torch.Tensor | None,
                  tensor_scale: torch.Tensor | None, axis: int) -> torch.Tensor | None:
    """The C kernel along ``axis`` of contiguous float32 ``x``. It takes one scale as a
    number; a scale per vector (broadcasting against ``x``) is divided out before and
    multiplied back after, the same two float32 steps the kernel takes inside."""
    if tensor_scale is None or tensor_scale.numel() == 1:
        return cpu_ops.quantize_rows(_code(fmt), x, noise, tensor_scale, axis)
    out = cpu_ops.quantize_rows(_code(fmt), (x / tensor_scale).contiguous(), noise, None, axis)
    return out * tensor_scale


def _code(fmt: KernelFormat) -> int:
    """``fmt``'s kernel code; only called once a backend was chosen, so it has kernels."""
    assert fmt.kernels is not None
    return int(fmt.kernels.code)


def resq_rows(fmt: KernelFormat, rows: torch.Tensor, keep: int, group: int) -> torch.Tensor | None:
    """Fused Rollout-ResQ activation ``Q(x) + S_{keep:group}(Q(x - Q(x)))`` (group 0: dense).

    Returns None where no fused path applies; the caller then composes the steps.
    """
    kernels = _resq_backend(fmt, rows, Operation.RESQ, group, (torch.float32,))
    if kernels is None:
        return None
    if kernels is cpu:
        return cpu_ops.resq_rows(_code(fmt), rows.contiguous(), keep, group)
    return kernels.fused_resq(fmt, rows, keep, group)


def _resq_backend(fmt: KernelFormat, rows: torch.Tensor, op: Operation, group: int,
                  dtypes: tuple[torch.dtype, ...]) -> ModuleType | None:
    """The backend that runs ResQ's ``op`` on ``rows``, or None: a dtype it does not read,
    or an n:m group wider than the C kernel takes."""
    if rows.dtype not in dtypes:
        return None
    return _resq_kernels(fmt, rows.device, op, group)


def _resq_kernels(fmt: KernelFormat, device: torch.device, op: Operation,
                  group: int) -> ModuleType | None:
    """The backend that runs ResQ's ``op`` with n:m ``group`` on ``device``, or None where
    the group is wider than the C kernel takes: the one place that rule lives."""
    kernels = _backend(fmt, device, op)
    return None if kernels is cpu and group > RESQ_MAX_GROUP else kernels


def resq_is_c(fmt: KernelFormat, op: Operation, group: int) -> bool:
    """Whether the C kernel runs ResQ's ``op`` with n:m ``group`` (0: dense) on CPU
    tensors, as chosen now (a plan kept across calls asks this once)."""
    return _resq_kernels(fmt, torch.device("cpu"), op, group) is cpu


def resq_terms(fmt: KernelFormat, rows: torch.Tensor, keep: int,
               group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """ResQ's two bf16 GEMM operands ``Q(x)`` and ``S_{keep:group}(Q(x - Q(x)))`` of float32
    or bfloat16 rows in one pass (the terms :func:`resq_rows` sums), or None where no
    fused path applies. The two are consecutive halves of one buffer, so a GEMM of both
    reads them without a copy (see :func:`fp4rl.gemm.mm`)."""
    kernels = _resq_backend(fmt, rows, Operation.RESQ_TERMS, group, (torch.float32, torch.bfloat16))
    if kernels is None:
        return None
    if kernels is cpu:
        out = cpu_ops.resq_terms(_code(fmt), rows.contiguous(), keep, group)
    else:
        out = kernels.resq_terms(fmt, rows, keep, group)
    if out is None:
        return None
    n = rows.shape[0]
    return out[:n], out[n:]


def quantize_rows_bf16(fmt: KernelFormat, rows: torch.Tensor,
                       tensor_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """``Q(x / g)`` along the rows of a bfloat16 matrix, nearest rounding, in bfloat16 (the
    same values as quantizing its float32 widening; every block value is exact in bf16),
    read and written once; ``tensor_scale`` g (NVFP4) stays outside, as a GEMM operand
    keeps it. None where no kernel applies (the C kernel has no per-tensor scale)."""
    if rows.dtype != torch.bfloat16 or rows.dim() != 2:
        return None
    kernels = _backend(fmt, rows.device, Operation.ROWS_BF16)
    if kernels is None:
        return None
    if kernels is cpu:
        return None if tensor_scale is not None else \
            cpu_ops.quantize_bf16(_code(fmt), rows.contiguous())
    return kernels.quantize_2d(fmt, rows, 1, None, tensor_scale,
                               out_dtype=torch.bfloat16, rescale=False)


def quantize_matrix_values(fmt: KernelFormat, x: torch.Tensor, axis: int,
                           tensor_scale: torch.Tensor | None,
                           out_dtype: torch.dtype) -> torch.Tensor | None:
    """The block values ``Q(x / g)`` of a float matrix along ``axis`` (nearest rounding),
    written by the kernel straight into ``out_dtype`` (bf16 holds them exactly), with
    ``tensor_scale`` g read and kept outside, as a GEMM operand keeps it: one read of
    ``x`` and one write of the operand, where quantizing into ``x``'s dtype and casting
    after takes two more passes (and NVFP4 a division before). Triton, or the C kernel
    where it runs :attr:`Operation.BOTH` for ``fmt`` (float32 or bfloat16 out, one scale
    per tensor or none); None elsewhere (the caller composes the steps)."""
    if x.dim() != 2 or not has_matrix_kernel(fmt, x):
        return None
    tri = triton_for(x.device)
    if tri is None:
        out = _values_cpu(fmt, x, axis % 2 == 1, axis % 2 == 0, tensor_scale, out_dtype)
        return None if out is None else out[0]
    return tri.quantize_2d(fmt, x, axis % 2, None, tensor_scale, out_dtype=out_dtype,
                           rescale=False)


def _values_cpu(fmt: KernelFormat, x: torch.Tensor, rows: bool, cols: bool,
                tensor_scale: torch.Tensor | None, out_dtype: torch.dtype
                ) -> list[torch.Tensor] | None:
    """The C kernel's block values of a matrix along its rows and/or its columns
    (``[rows, cols]``, those asked for) in ``out_dtype``, in one call (a pass along each
    axis asked for: on a CPU two passes beat one read of tiles, see quant.c); None
    where it does not apply: no such kernel for ``fmt``, an empty matrix, an output dtype
    other than float32 and bfloat16, or a scale per vector. ``x`` is read in float32 or
    bfloat16 as it is (other dtypes are widened first), a transposed view without a
    copy. The one scale is read as a number inside the operator, as the C quantizer's
    (never 0: a format's scale is 1 where a tensor has no finite non-zero value)."""
    if x.dim() != 2 or _backend(fmt, x.device, Operation.BOTH) is not cpu or \
            x.numel() == 0 or out_dtype not in (torch.float32, torch.bfloat16) or \
            (tensor_scale is not None and tensor_scale.numel() != 1):
        return None
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    flipped = not x.is_contiguous() and x.t().is_contiguous()  # a transposed view
    if flipped:
        x, rows, cols = x.t(), cols, rows
    out = cpu_ops.quantize_values(_code(fmt), x.contiguous(), rows, cols, tensor_scale,
                                  out_dtype)
    return [o.t() for o in reversed(out)] if flipped else out


def quantize_both(fmt: KernelFormat, x: torch.Tensor, tensor_scale: torch.Tensor | None,
                  out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The block values ``Q(x / g)`` of a float matrix along its rows and along its columns
    (nearest rounding), in ``out_dtype``, in one call (a GEMM operand and its backward
    GEMM's), ``tensor_scale`` g (one value) kept outside. Triton, from one read of ``x``,
    or the C kernel, a pass along each axis (see :func:`_values_cpu`); None elsewhere (the
    caller quantizes along each axis)."""
    tri = _backend(fmt, x.device, Operation.BOTH)
    if tri is cpu:
        values = _values_cpu(fmt, x, True, True, tensor_scale, out_dtype)
        return None if values is None else (values[0], values[1])
    if tri is None or x.numel() == 0:
        return None
    out: tuple[torch.Tensor, torch.Tensor] | None = tri.quantize_both(fmt, x, tensor_scale,
                                                                        out_dtype)
    return out


def finite_amax(x: torch.Tensor) -> torch.Tensor | None:
    """The largest finite ``|x|`` (0 if none) as a 0-dim float32 tensor, by one Triton pass
    (an atomic max of the bits) where the Triton kernels run for ``x``'s device; None
    elsewhere (the caller reduces with torch)."""
    tri = triton_for(x.device)
    if tri is None or x.numel() == 0 or x.dtype not in (torch.float32, torch.bfloat16,
                                                        torch.float16):
        return None
    return tri.finite_amax(x)


def has_nm_terms(fmt: KernelFormat, device: torch.device, group: int) -> bool:
    """Whether :func:`resq_terms_nm` runs a kernel for ``fmt``'s rows on ``device`` at an
    n:m ``group``: Triton (a GPU), a format the ResQ kernels take, a group they rank."""
    if not group or triton_for(device) is None:
        return False
    from fp4rl.kernels import triton_quant

    return _backend(fmt, device, Operation.RESQ_TERMS) is not None and \
        triton_quant.fuses_resq(fmt, group)


def resq_terms_nm(fmt: KernelFormat, rows: torch.Tensor, keep: int, group: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """ResQ's two GEMM operands of float32 or bfloat16 rows in one pass, the residual kept
    n:m sparse (``Q(x)``, the kept values, their bits: :class:`fp4rl.gemm.NMOperand`), for
    the packed GEMM, which expands it in registers; None where no kernel applies (a CPU,
    the C kernels: they write the dense terms) or ``group`` is 0."""
    if not group:
        return None
    kernels = _resq_backend(fmt, rows, Operation.RESQ_TERMS, group, (torch.float32, torch.bfloat16))
    if kernels is None or kernels is cpu:
        return None
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = \
        kernels.resq_terms_nm(fmt, rows, keep, group)
    return out


def _amax_backend(x: torch.Tensor) -> ModuleType | None:
    """The Triton kernels that reduce ``x``'s vectors (a non-empty float matrix on a device
    they run on), or None (the caller reduces with torch)."""
    if x.dim() != 2 or x.numel() == 0 or x.dtype not in (
            torch.float32, torch.bfloat16, torch.float16):
        return None
    return triton_for(x.device)


def vector_amax(x: torch.Tensor, dim: int) -> torch.Tensor | None:
    """Each vector's largest finite ``|x|`` along ``dim`` of a matrix, float32, the reduced
    axis kept, by one Triton pass where the Triton kernels run for ``x``'s device; None
    elsewhere (the caller reduces with torch)."""
    tri = _amax_backend(x)
    if tri is None:
        return None
    out: torch.Tensor = tri.vector_amax(x, dim)
    return out


def vector_amax_both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(vector_amax(x, -1), vector_amax(x, 0))`` from one Triton pass over ``x``; None
    where :func:`vector_amax` would be."""
    tri = _amax_backend(x)
    if tri is None:
        return None
    out: tuple[torch.Tensor, torch.Tensor] = tri.vector_amax_both(x)
    return out


def decode_rows(fmt: KernelFormat, fields: dict[str, torch.Tensor], rows: int, length: int,
                dtype: torch.dtype) -> torch.Tensor | None:
    """The values of a weight packed along its rows (fields laid out per row, as
    :meth:`fp4rl.gemm.PackedOperand.row_fields` gives them) in ``dtype``, by a kernel, or
    None where none applies (the caller decodes through the format's tables)."""
    if _backend(fmt, fields["codes"].device, Operation.DECODE) is None:
        return None
    from fp4rl.kernels import triton_decode

    return triton_decode.decode_2d(fmt, fields, rows, length, dtype)


def has_packed_mm(fmt: KernelFormat, device: torch.device) -> bool:
    """Whether :func:`packed_mm` runs a kernel for ``fmt`` on ``device``."""
    return _backend(fmt, device, Operation.PACKED_MM) is not None


def packed_mm(fmt: KernelFormat, a: torch.Tensor, terms: int, fields: dict[str, torch.Tensor],
              rows: int, cols: int, term_scales: list[torch.Tensor | None],
              weight_scale: torch.Tensor | None, bias: torch.Tensor | None,
              residual: tuple[torch.Tensor, torch.Tensor, int, int] | None = None
              ) -> torch.Tensor | None:
    """``sum_t (a_t @ W.T) * s_t * ws + bias`` with ``W`` packed along its rows (fields as
    :meth:`fp4rl.gemm.PackedOperand.row_fields` lays them out), decoded in registers, by a
    kernel; None where none applies (the caller decodes, then multiplies). ``residual``:
    the second term n:m sparse (values, bits, keep, group), ``a`` the first alone."""
    if _backend(fmt, a.device, Operation.PACKED_MM) is None:
        return None
    from fp4rl.kernels import triton_packed_mm

    return triton_packed_mm.packed_mm_2d(fmt, a, terms, fields, rows, cols, term_scales,
                                         weight_scale, bias, residual)


def quantize_on_load() -> bool:
    """Whether the training GEMMs quantize their activation and gradient operands as they
    load them (:mod:`.triton_qmm`): ``FP4RL_QUANTIZE_ON_LOAD=1``. Off by default: the fused
    kernel moves fewer bytes, but repeats the quantizer's arithmetic once per program
    along the other axis (``fp4rl bench linear --traffic`` counts both), and no GPU has
    timed it against quantize-then-multiply yet (``benchmarks/gpu_check.py --only speed``
    does)."""
    return os.environ.get("FP4RL_QUANTIZE_ON_LOAD") == "1"


def has_qmm(fmt: KernelFormat, device: torch.device) -> bool:
    """Whether :func:`qmm` quantizes operands in ``fmt`` on load on ``device``: Triton,
    a format declaring it (its blocks along one axis, and its quantizer fitting a GEMM
    tile's registers), and :func:`quantize_on_load`."""
    return quantize_on_load() and _backend(fmt, device, Operation.QMM) is not None


def qmm(a: torch.Tensor, a_fmt: KernelFormat | None, a_scale: torch.Tensor | None,
        b: torch.Tensor, b_fmt: KernelFormat | None, b_scale: torch.Tensor | None,
        bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """``(Qa(a / sa) sa) @ (Qb(b / sb) sb) + bias`` rounded once to bf16 and stored in
    ``out_dtype``, each of ``a`` (M, K) and ``b`` (K, N) quantized along K as the kernel
    loads it where its format is given, else read as it is (bf16 block values); None where
    the kernel does not apply (the caller quantizes, then multiplies)."""
    for fmt in (a_fmt, b_fmt):
        if fmt is not None and not has_qmm(fmt, a.device):
            return None
    if a_fmt is None and b_fmt is None:
        return None
    from fp4rl.kernels import triton_qmm

    return triton_qmm.qmm(a, a_fmt, a_scale, b, b_fmt, b_scale, bias, out_dtype)


__all__ = ["RESQ_MAX_GROUP", "backend_is_c", "decode_rows", "finite_amax", "has_kernel",
           "has_matrix_kernel", "has_nm_terms", "has_packed_mm", "has_qmm", "kernel_choice",
           "kernel_plan", "packed_mm", "qmm", "quantize_both", "quantize_matrix",
           "quantize_matrix_values", "quantize_on_load", "quantize_rows", "quantize_rows_bf16",
           "resq_is_c", "resq_rows", "resq_terms", "resq_terms_nm", "triton_for", "vector_amax",
           "vector_amax_both"]
