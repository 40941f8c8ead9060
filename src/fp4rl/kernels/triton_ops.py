"""The Triton launchers of :mod:`.triton_quant` as torch custom operators (``fp4rl::...``,
each with a fake), which is how the kernel dispatch (:mod:`fp4rl.kernels.dispatch`) calls
them on a GPU: ``torch.compile`` traces each as one opaque op with its fake's shapes, a
CUDA graph captures its launch, and a ``TorchDispatchMode`` sees every launch with its
inputs and outputs (the rollout's operators, the packed decode and the packed GEMM are
custom operators of their own: :mod:`fp4rl.recovery.ops`, :mod:`fp4rl.gemm`).

The same functions as :mod:`.triton_quant` (this module stands in for it), taking the
format object; an operator takes the format as what its kernels read of it (the code,
the block size, whether it has a tensor scale), so this layer needs no format registry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4rl.kernels import triton_quant as tq
from fp4rl.kernels.base import OPERATIONS, FormatKernels, KernelFormat
from fp4rl.kernels.codes import FormatCode


@dataclass(frozen=True)
class _Format:
    """What the launchers read of a format, rebuilt inside an operator."""

    name: str
    block_size: int
    kernels: FormatKernels
    has_tensor_scale: bool


def _fields(fmt: KernelFormat) -> tuple[int, int, bool]:
    code, bs = tq.format_fields(fmt)
    return code, bs, fmt.has_tensor_scale


def _format(code: int, block: int, tensor_scale: bool) -> _Format:
    return _Format(FormatCode(code).name.lower(), block,
                   FormatKernels(FormatCode(code), triton=frozenset(OPERATIONS)), tensor_scale)


@torch.library.custom_op("fp4rl::quantize_2d", mutates_args=())
def _quantize(x: torch.Tensor, code: int, block: int, has_scale: bool, axis: int,
              noise: torch.Tensor | None, tensor_scale: torch.Tensor | None,
              out_dtype: torch.dtype, rescale: bool) -> torch.Tensor:
    return tq.quantize_2d(_format(code, block, has_scale), x, axis, noise, tensor_scale,
                          out_dtype, rescale)


@_quantize.register_fake
def _(x: torch.Tensor, code: int, block: int, has_scale: bool, axis: int,
      noise: torch.Tensor | None, tensor_scale: torch.Tensor | None, out_dtype: torch.dtype,
      rescale: bool) -> torch.Tensor:
    if not (x.is_contiguous() or x.t().is_contiguous()):
        x = x.contiguous()
    return torch.empty_like(x, dtype=out_dtype)


def quantize_2d(fmt: KernelFormat, x: torch.Tensor, axis: int, noise: torch.Tensor | None = None,
                tensor_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                rescale: bool = True) -> torch.Tensor:
    """:func:`.triton_quant.quantize_2d` as the ``fp4rl::quantize_2d`` operator."""
    if x.dim() != 2 or x.dtype not in tq.FLOATS or axis not in (0, 1):
        raise ValueError("quantize_2d takes a float matrix and axis 0 or 1")
    y: torch.Tensor = torch.ops.fp4rl.quantize_2d(x, *_fields(fmt), axis, noise, tensor_scale,
                                                  out_dtype or x.dtype, rescale)
    return y


@torch.library.custom_op("fp4rl::quantize_both", mutates_args=())
def _both(x: torch.Tensor, code: int, block: int, has_scale: bool,
          tensor_scale: torch.Tensor | None, out_dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    out = tq.quantize_both(_format(code, block, has_scale), x, tensor_scale, out_dtype)
    assert out is not None  # the caller checked the types
    return out


@_both.register_fake
def _(x: torch.Tensor, code: int, block: int, has_scale: bool,
      tensor_scale: torch.Tensor | None, out_dtype: torch.dtype
      ) -> tuple[torch.Tensor, torch.Tensor]:
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape, dtype=out_dtype))


def quantize_both(fmt: KernelFormat, x: torch.Tensor, tensor_scale: torch.Tensor | None,
                  out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`.triton_quant.quantize_both` as the ``fp4rl::quantize_both`` operator."""
    if x.dim() != 2 or (x.dtype, out_dtype) not in tq.BOTH_TYPES:
        return None
    out: tuple[torch.Tensor, torch.Tensor] = torch.ops.fp4rl.quantize_both(
        x, *_fields(fmt), tensor_scale, out_dtype)
    return out


@torch.library.custom_op("fp4rl::finite_amax", mutates_args=())
def _amax(x: torch.Tensor) -> torch.Tensor:
    return tq.finite_amax(x)


@_amax.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((), dtype=torch.float32)


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """:func:`.triton_quant.finite_amax` as the ``fp4rl::finite_amax`` operator."""
    out: torch.Tensor = torch.ops.fp4rl.finite_amax(x)
    return out


@torch.library.custom_op("fp4rl::vector_amax", mutates_args=())
def _vector_amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return tq.vector_amax(x, dim)


@_vector_amax.register_fake
def _(x: torch.Tensor, dim: int) -> torch.Tensor:
    shape = (1, x.shape[1]) if dim % 2 == 0 else (x.shape[0], 1)
    return x.new_empty(shape, dtype=torch.float32)


def vector_amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """:func:`.triton_quant.vector_amax` as the ``fp4rl::vector_amax`` operator."""
    out: torch.Tensor = torch.ops.fp4rl.vector_amax(x, dim)
    return out


@torch.library.custom_op("fp4rl::vector_amax_both", mutates_args=())
def _vector_amax_both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tq.vector_amax_both(x)


@_vector_amax_both.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (x.new_empty((x.shape[0], 1), dtype=torch.float32),
            x.new_empty((1, x.shape[1]), dtype=torch.float32))


def vector_amax_both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.triton_quant.vector_amax_both` as the ``fp4rl::vector_amax_both`` operator."""
    rows, cols = torch.ops.fp4rl.vector_amax_both(x)
    return rows, cols


@torch.library.custom_op("fp4rl::fused_resq", mutates_args=())
def _resq(rows: torch.Tensor, code: int, block: int, has_scale: bool, keep: int,
          group: int) -> torch.Tensor:
    out = tq.fused_resq(_format(code, block, has_scale), rows, keep, group)
    assert out is not None  # the caller checked fuses_resq
    return out


@_resq.register_fake
def _(rows: torch.Tensor, code: int, block: int, has_scale: bool, keep: int,
      group: int) -> torch.Tensor:
    return rows.new_empty(rows.shape)


def fused_resq(fmt: KernelFormat, rows: torch.Tensor, keep: int, group: int
               ) -> torch.Tensor | None:
    """:func:`.triton_quant.fused_resq` as the ``fp4rl::fused_resq`` operator."""
    if not tq.fuses_resq(fmt, group):
        return None
    out: torch.Tensor = torch.ops.fp4rl.fused_resq(rows, *_fields(fmt), keep, group)
    return out


@torch.library.custom_op("fp4rl::resq_terms", mutates_args=())
def _terms(rows: torch.Tensor, code: int, block: int, has_scale: bool, keep: int,
           group: int) -> torch.Tensor:
    out = tq.resq_terms(_format(code, block, has_scale), rows, keep, group)
    assert out is not None  # the caller checked fuses_resq and the type
    return out


@_terms.register_fake
def _(rows: torch.Tensor, code: int, block: int, has_scale: bool, keep: int,
      group: int) -> torch.Tensor:
    return rows.new_empty((2 * rows.shape[0], rows.shape[1]), dtype=torch.bfloat16)


def resq_terms(fmt: KernelFormat, rows: torch.Tensor, keep: int, group: int
               ) -> torch.Tensor | None:
    """:func:`.triton_quant.resq_terms` as the ``fp4rl::resq_terms`` operator."""
    if not tq.fuses_resq(fmt, group) or rows.dtype not in tq.RESQ_TERMS_INPUTS:
        return None
    out: torch.Tensor = torch.ops.fp4rl.resq_terms(rows, *_fields(fmt), keep, group)
    return out


@torch.library.custom_op("fp4rl::resq_terms_nm", mutates_args=())
def _terms_nm(rows: torch.Tensor, code: int, block: int, has_scale: bool, keep: int,
              group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = tq.resq_terms_nm(_format(code, block, has_scale), rows, keep, group)
    assert out is not None  # the caller checked fuses_resq, the group and the type
    return out


@_terms_nm.register_fake
def _(rows: torch.Tensor, code: int, block: int, has_scale: bool, keep: int,
      group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, length = rows.shape
    groups = -(-length // group)
    return (rows.new_empty((n, length), dtype=torch.bfloat16),
            rows.new_empty((n, groups * keep), dtype=torch.bfloat16),
            rows.new_empty((n, groups), dtype=torch.uint8))


def resq_terms_nm(fmt: KernelFormat, rows: torch.Tensor, keep: int, group: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`.triton_quant.resq_terms_nm` as the ``fp4rl::resq_terms_nm`` operator."""
    if not group or not tq.fuses_resq(fmt, group) or rows.dtype not in tq.RESQ_TERMS_INPUTS:
        return None
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = torch.ops.fp4rl.resq_terms_nm(
        rows, *_fields(fmt), keep, group)
    return out


__all__ = ["finite_amax", "fused_resq", "quantize_2d", "quantize_both", "resq_terms",
           "resq_terms_nm"]
