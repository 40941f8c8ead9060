"""Fast paths behind the format functions: a fused C kernel on CPU, Triton on GPU.

Every fast path is bit-identical to the float64 reference in :mod:`fp4rl.formats`;
the functions here return None where no fast path applies, and the caller then uses
the reference (which runs on any device). CUDA tensors take the Triton kernels;
``FP4RL_KERNELS=triton`` sends CPU tensors there too, which with ``TRITON_INTERPRET=1``
runs them through Triton's interpreter (how they are tested without a GPU).
``FP4RL_DISABLE_KERNELS=1`` turns every fast path off.
"""

from __future__ import annotations

import os
import warnings
from functools import cache
from types import ModuleType

import torch

from fp4rl.kernels.cpu import load_library, quantize_rows_cpu, resq_rows_cpu

#: kernel ids whose fused ResQ path exists (NVFP4's per-tensor scale needs two passes)
RESQ_KERNELS = (0, 1, 3)
#: largest n:m group the fused CPU path handles
RESQ_MAX_GROUP = 64


@cache
def _triton() -> ModuleType | None:
    try:
        from fp4rl.kernels import triton_quant
    except ImportError as err:  # no triton wheel for this platform
        warnings.warn(f"fp4rl: Triton kernels unavailable, using the reference path ({err})",
                      RuntimeWarning, stacklevel=3)
        return None
    return triton_quant


def _triton_for(t: torch.Tensor) -> ModuleType | None:
    """The Triton kernel module if ``t`` should use it (and it is importable)."""
    if os.environ.get("FP4RL_DISABLE_KERNELS") == "1":
        return None
    if t.device.type == "cuda" or os.environ.get("FP4RL_KERNELS") == "triton":
        return _triton()
    return None


def has_matrix_kernel(x: torch.Tensor) -> bool:
    """Whether :func:`quantize_matrix` runs for ``x`` (a kernel for either axis exists)."""
    if _triton_for(x) is not None:
        return True
    return x.device.type == "cpu" and load_library() is not None


def quantize_rows(kernel_id: int, rows: torch.Tensor, noise: torch.Tensor | None,
                  tensor_scale: float | None = None) -> torch.Tensor | None:
    """Fake-quantize contiguous float32 ``(R, L)`` rows along L, or None if no fast path.

    ``tensor_scale`` g (NVFP4's per-tensor scale) quantizes ``rows / g`` and returns
    the result times g, both steps in float32.
    """
    if noise is not None:
        noise = noise.contiguous()
    tri = _triton_for(rows)
    if tri is not None:
        return tri.quantize_2d(kernel_id, rows, 1, noise, tensor_scale)
    if rows.device.type != "cpu":
        return None
    return quantize_rows_cpu(kernel_id, rows, noise, tensor_scale)


def quantize_matrix(kernel_id: int, x: torch.Tensor, axis: int, noise: torch.Tensor | None,
                    tensor_scale: float | None = None) -> torch.Tensor:
    """Fake-quantize a float32 matrix along ``axis`` without a transposed copy; only where
    :func:`has_matrix_kernel`. ``noise`` is laid out as rows along ``axis``."""
    if noise is not None:
        noise = noise.contiguous()
    tri = _triton_for(x)
    if tri is not None:
        return tri.quantize_2d(kernel_id, x, axis, noise, tensor_scale)
    if not x.is_contiguous() and x.t().is_contiguous():  # a transposed view: flip the axis
        return quantize_matrix(kernel_id, x.t(), 1 - axis, noise, tensor_scale).t()
    out = quantize_rows_cpu(kernel_id, x.contiguous(), noise, tensor_scale, axis)
    if out is None:
        raise RuntimeError("no quantization kernel for this tensor (see has_matrix_kernel)")
    return out


def resq_rows(kernel_id: int, rows: torch.Tensor, keep: int, group: int) -> torch.Tensor | None:
    """Fused Rollout-ResQ activation ``Q(x) + S_{keep:group}(Q(x - Q(x)))`` (group 0: dense).

    Returns None where no fused path applies; the caller then composes the steps.
    """
    if rows.dtype != torch.float32 or kernel_id not in RESQ_KERNELS:
        return None
    tri = _triton_for(rows)
    if tri is not None:
        return tri.fused_resq(kernel_id, rows, keep, group)
    if rows.device.type != "cpu" or group > RESQ_MAX_GROUP:
        return None
    return resq_rows_cpu(kernel_id, rows.contiguous(), keep, group)


__all__ = ["has_matrix_kernel", "quantize_matrix", "quantize_rows", "resq_rows"]
