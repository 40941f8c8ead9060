"""The C kernels' quantizers and fp32-output GEMM (:mod:`.cpu`) as torch custom operators
(``fp4rl::c_...``, each with a fake), which is how the kernel dispatch
(:mod:`fp4rl.kernels.dispatch`) and :func:`fp4rl.gemm.mm_fp32` call them on a CPU:
``torch.compile`` traces each as one opaque op with its fake's shapes instead of breaking
its graph at a ``ctypes`` call and a data pointer, as :mod:`.triton_ops` does for the
Triton launchers. Each is called only once the library is known to be built
(:func:`available`)."""

from __future__ import annotations

import torch

from fp4rl.kernels import cpu


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the C library is built (and not switched off): a constant of the process,
    which a compiled graph reads at its trace, not at each call."""
    return cpu.load_library() is not None


def _number(tensor_scale: torch.Tensor | None) -> float | None:
    """A CPU tensor's one scale as the number the C kernel takes (no sync on a CPU)."""
    return None if tensor_scale is None else float(tensor_scale.reshape(()))


def _built(out: torch.Tensor | None) -> torch.Tensor:
    if out is None:  # the dispatch checked available() first
        raise RuntimeError("the C kernel library is not built")
    return out


@torch.library.custom_op("fp4rl::c_quantize", mutates_args=())
def _quantize(x: torch.Tensor, code: int, noise: torch.Tensor | None,
              tensor_scale: torch.Tensor | None, axis: int) -> torch.Tensor:
    return _built(cpu.quantize_rows_cpu(code, x, noise, _number(tensor_scale), axis))


@_quantize.register_fake
def _(x: torch.Tensor, code: int, noise: torch.Tensor | None,
      tensor_scale: torch.Tensor | None, axis: int) -> torch.Tensor:
    return torch.empty_like(x)


def quantize_rows(code: int, x: torch.Tensor, noise: torch.Tensor | None,
                  tensor_scale: torch.Tensor | None, axis: int) -> torch.Tensor:
    """:func:`.cpu.quantize_rows_cpu` of contiguous float32 ``x`` with one scale (a tensor
    of one value, or None), as the ``fp4rl::c_quantize`` operator."""
    out: torch.Tensor = torch.ops.fp4rl.c_quantize(x, code, noise, tensor_scale, axis)
    return out


@torch.library.custom_op("fp4rl::c_resq", mutates_args=())
def _resq(rows: torch.Tensor, code: int, keep: int, group: int) -> torch.Tensor:
    return _built(cpu.resq_rows_cpu(code, rows, keep, group))


@_resq.register_fake
def _(rows: torch.Tensor, code: int, keep: int, group: int) -> torch.Tensor:
    return torch.empty_like(rows)


def resq_rows(code: int, rows: torch.Tensor, keep: int, group: int) -> torch.Tensor:
    """:func:`.cpu.resq_rows_cpu` as the ``fp4rl::c_resq`` operator."""
    out: torch.Tensor = torch.ops.fp4rl.c_resq(rows, code, keep, group)
    return out


@torch.library.custom_op("fp4rl::c_resq_terms", mutates_args=())
def _terms(rows: torch.Tensor, code: int, keep: int, group: int) -> torch.Tensor:
    return _built(cpu.resq_terms_cpu(code, rows, keep, group))


@_terms.register_fake
def _(rows: torch.Tensor, code: int, keep: int, group: int) -> torch.Tensor:
    return rows.new_empty((2 * rows.shape[0], rows.shape[1]), dtype=torch.bfloat16)


def resq_terms(code: int, rows: torch.Tensor, keep: int, group: int) -> torch.Tensor:
    """:func:`.cpu.resq_terms_cpu` as the ``fp4rl::c_resq_terms`` operator."""
    out: torch.Tensor = torch.ops.fp4rl.c_resq_terms(rows, code, keep, group)
    return out


@torch.library.custom_op("fp4rl::c_quantize_bf16", mutates_args=())
def _bf16(rows: torch.Tensor, code: int) -> torch.Tensor:
    return _built(cpu.quantize_bf16_cpu(code, rows))


@_bf16.register_fake
def _(rows: torch.Tensor, code: int) -> torch.Tensor:
    return torch.empty_like(rows)


def quantize_bf16(code: int, rows: torch.Tensor) -> torch.Tensor:
    """:func:`.cpu.quantize_bf16_cpu` as the ``fp4rl::c_quantize_bf16`` operator."""
    out: torch.Tensor = torch.ops.fp4rl.c_quantize_bf16(rows, code)
    return out


@torch.library.custom_op("fp4rl::c_quantize_values", mutates_args=())
def _values(x: torch.Tensor, code: int, rows: bool, cols: bool,
            tensor_scale: torch.Tensor | None, out_dtype: torch.dtype) -> list[torch.Tensor]:
    out = cpu.quantize_values_cpu(code, x, rows, cols, _number(tensor_scale), out_dtype)
    if out is None:  # the dispatch checked available() first
        raise RuntimeError("the C kernel library is not built")
    return out


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
    out: list[torch.Tensor] = torch.ops.fp4rl.c_quantize_values(x, code, rows, cols,
                                                                tensor_scale, out_dtype)
    return out


@torch.library.custom_op("fp4rl::c_mm_fp32", mutates_args=())
def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return cpu.bi_gemm(a, b, out_dtype=torch.float32)


@_mm_fp32.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 2-D bf16 ``a`` and ``b`` with fp32 accumulation, in fp32 (no rounding to
    bf16): the C library's fixed-order GEMM (:func:`.cpu.bi_gemm`), as the
    ``fp4rl::c_mm_fp32`` operator, so that a compiled graph and a dispatch mode see one op
    and a compiled forward gives the eager bits."""
    out: torch.Tensor = torch.ops.fp4rl.c_mm_fp32(a, b)
    return out


__all__ = ["available", "mm_fp32", "quantize_bf16", "quantize_rows", "quantize_values",
           "resq_rows", "resq_terms"]
