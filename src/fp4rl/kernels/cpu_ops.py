"""The C kernels' quantizers and fp32-output GEMM (:mod:`.cpu`) as torch custom operators
(``fp4rl::c_...``, each with a fake), which is how the kernel dispatch
(:mod:`fp4rl.kernels.dispatch`) and :func:`fp4rl.gemm.mm_fp32` call them on a CPU:
``torch.compile`` traces each as one opaque op with its fake's shapes instead of breaking
its graph at a ``ctypes`` call and a data pointer, as :mod:`.triton_ops` does for the
Triton launchers, and a dispatch mode sees each as one op. A plain eager call, where
nothing would see the op, calls its function directly (:func:`_direct`). Each is called
only once the library is known to be built (:func:`available`)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from fp4rl.kernels import cpu


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the C library is built (and not switched off): a constant of the process,
    which a compiled graph reads at its trace, not at each call."""
    return cpu.load_library() is not None


def _direct(*tensors: torch.Tensor | None) -> bool:
    """Whether a call may go straight to the C kernel, past the operator's dispatch (about
    30 us a call: on a decode step of a small model, as long as the kernel's own work):
    in eager mode (nothing traced or compiled), with no dispatch mode on the stack that
    must see the op (a counter, a tracer; fp4rl's batch-invariant mode passes these ops
    through as they are and says so: ``passes_c_ops``), on plain tensors that need no
    gradient. The same function runs either way."""
    if torch.compiler.is_compiling():
        return False
    if torch._C._len_torch_dispatch_stack() > 0 and not all(
            getattr(mode, "passes_c_ops", False) for mode in _get_current_dispatch_mode_stack()):
        return False
    grad = torch.is_grad_enabled()
    return all(type(t) is torch.Tensor and not (grad and t.requires_grad)
               for t in tensors if t is not None)


def _number(tensor_scale: torch.Tensor | None) -> float | None:
    """A CPU tensor's one scale as the number the C kernel takes (no sync on a CPU)."""
    return None if tensor_scale is None else float(tensor_scale.reshape(()))


def _built(out: torch.Tensor | None) -> torch.Tensor:
    if out is None:  # the dispatch checked available() first
        raise RuntimeError("the C kernel library is not built")
    return out


def _quantize_impl(x: torch.Tensor, code: int, noise: torch.Tensor | None,
                   tensor_scale: torch.Tensor | None, axis: int) -> torch.Tensor:
    return _built(cpu.quantize_rows_cpu(code, x, noise, _number(tensor_scale), axis))


_quantize = torch.library.custom_op("fp4rl::c_quantize", _quantize_impl, mutates_args=())


@_quantize.register_fake
def _(x: torch.Tensor, code: int, noise: torch.Tensor | None,
      tensor_scale: torch.Tensor | None, axis: int) -> torch.Tensor:
    return torch.empty_like(x)


def quantize_rows(code: int, x: torch.Tensor, noise: torch.Tensor | None,
                  tensor_scale: torch.Tensor | None, axis: int) -> torch.Tensor:
    """:func:`.cpu.quantize_rows_cpu` of contiguous float32 ``x`` with one scale (a tensor
    of one value, or None), as the ``fp4rl::c_quantize`` operator."""
    if _direct(x, noise, tensor_scale):
        return _quantize_impl(x, code, noise, tensor_scale, axis)
    out: torch.Tensor = torch.ops.fp4rl.c_quantize(x, code, noise, tensor_scale, axis)
    return out


def _resq_impl(rows: torch.Tensor, code: int, keep: int, group: int) -> torch.Tensor:
    return _built(cpu.resq_rows_cpu(code, rows, keep, group))


_resq = torch.library.custom_op("fp4rl::c_resq", _resq_impl, mutates_args=())


@_resq.register_fake
def _(rows: torch.Tensor, code: int, keep: int, group: int) -> torch.Tensor:
    return torch.empty_like(rows)


def resq_rows(code: int, rows: torch.Tensor, keep: int, group: int) -> torch.Tensor:
    """:func:`.cpu.resq_rows_cpu` as the ``fp4rl::c_resq`` operator."""
    if _direct(rows):
        return _resq_impl(rows, code, keep, group)
    out: torch.Tensor = torch.ops.fp4rl.c_resq(rows, code, keep, group)
    return out


def _terms_impl(rows: torch.Tensor, code: int, keep: int, group: int) -> torch.Tensor:
    return _built(cpu.resq_terms_cpu(code, rows, keep, group))


_terms = torch.library.custom_op("fp4rl::c_resq_terms", _terms_impl, mutates_args=())


@_terms.register_fake
def _(rows: torch.Tensor, code: int, keep: int, group: int) -> torch.Tensor:
    return rows.new_empty((2 * rows.shape[0], rows.shape[1]), dtype=torch.bfloat16)


def resq_terms(code: int, rows: torch.Tensor, keep: int, group: int) -> torch.Tensor:
    """:func:`.cpu.resq_terms_cpu` as the ``fp4rl::c_resq_terms`` operator."""
    if _direct(rows):
        return _terms_impl(rows, code, keep, group)
    out: torch.Tensor = torch.ops.fp4rl.c_resq_terms(rows, code, keep, group)
    return out


def _bf16_impl(rows: torch.Tensor, code: int) -> torch.Tensor:
    return _built(cpu.quantize_bf16_cpu(code, rows))


_bf16 = torch.library.custom_op("fp4rl::c_quantize_bf16", _bf16_impl, mutates_args=())


@_bf16.register_fake
def _(rows: torch.Tensor, code: int) -> torch.Tensor:
    return torch.empty_like(rows)


def quantize_bf16(code: int, rows: torch.Tensor) -> torch.Tensor:
    """:func:`.cpu.quantize_bf16_cpu` as the ``fp4rl::c_quantize_bf16`` operator."""
    if _direct(rows):
        return _bf16_impl(rows, code)
    out: torch.Tensor = torch.ops.fp4rl.c_quantize_bf16(rows, code)
    return out


def _values_impl(x: torch.Tensor, code: int, rows: bool, cols: bool,
                 tensor_scale: torch.Tensor | None, out_dtype: torch.dtype) -> list[torch.Tensor]:
    out = cpu.quantize_values_cpu(code, x, rows, cols, _number(tensor_scale), out_dtype)
    if out is None:  # the dispatch checked available() first
        raise RuntimeError("the C kernel library is not built")
    return out


_values = torch.library.custom_op("fp4rl::c_quantize_values", _values_impl, mutates_args=())


@_values.register_fake
def _(x: torch.Tensor, code: int, rows: bool, cols: bool, tensor_scale: torch.Tensor | None,
      out_dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.empty_like(x, dtype=out_dtype) for wanted in (rows, cols) if wanted]


def quantize_values(code: int, x: torch.Tensor, rows: bool, cols: bool,
                    tensor_scale: torch.Tensor | None, out_dtype: torch.dtype
                    ) -> list[torch.Tensor]:
    """:func:`.cpu.quantize_values_cpu` of a contiguous float32 or bfloat16 matrix with one
    scale (a tensor of one value, or None), as the ``fp4rl::c_quantize_values``
    operator."""
    if _direct(x, tensor_scale):
        return _values_impl(x, code, rows, cols, tensor_scale, out_dtype)
    out: list[torch.Tensor] = torch.ops.fp4rl.c_quantize_values(x, code, rows, cols,
                                                                tensor_scale, out_dtype)
    return out


def _mm_fp32_impl(a: torch.Tensor, b: torch.Tensor, chunk: int) -> torch.Tensor:
    return cpu.bi_gemm(a, b, out_dtype=torch.float32, chunk=chunk)


_mm_fp32 = torch.library.custom_op("fp4rl::c_mm_fp32", _mm_fp32_impl, mutates_args=())


@_mm_fp32.register_fake
def _(a: torch.Tensor, b: torch.Tensor, chunk: int) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)


def mm_fp32(a: torch.Tensor, b: torch.Tensor, chunk: int = cpu.BI_CHUNK) -> torch.Tensor:
    """``a @ b`` of 2-D bf16 ``a`` and ``b`` with fp32 accumulation, in fp32 (no rounding to
    bf16): the C library's GEMM (:func:`.cpu.bi_gemm`, ``chunk`` its order: the
    batch-invariant runs by default), as the ``fp4rl::c_mm_fp32`` operator, so that a
    compiled graph and a dispatch mode see one op and a compiled forward gives the eager
    bits."""
    if _direct(a, b):
        return _mm_fp32_impl(a, b, chunk)
    out: torch.Tensor = torch.ops.fp4rl.c_mm_fp32(a, b, chunk)
    return out


__all__ = ["available", "mm_fp32", "quantize_bf16", "quantize_rows", "quantize_values",
           "resq_rows", "resq_terms"]
