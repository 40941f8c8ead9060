"""Fast paths behind the format functions: a fused C kernel on CPU.

Every fast path is bit-identical to the float64 reference in :mod:`fp4rl.formats`;
``quantize_rows`` returns None where no fast path applies, and the caller then
uses the reference (which runs on any device).
"""

from __future__ import annotations

import torch

from fp4rl.kernels.cpu import quantize_rows_cpu, resq_rows_cpu


def quantize_rows(kernel_id: int, rows: torch.Tensor, noise: torch.Tensor | None,
                  tensor_scale: float | None = None) -> torch.Tensor | None:
    """Fake-quantize contiguous float32 ``(R, L)`` rows along L, or None if no fast path.

    ``tensor_scale`` g (NVFP4's per-tensor scale) quantizes ``rows / g`` and returns
    the result times g, both steps in float32.
    """
    if rows.device.type != "cpu":
        return None
    if noise is not None:
        noise = noise.contiguous()
    return quantize_rows_cpu(kernel_id, rows, noise, tensor_scale)


#: kernel ids whose fused ResQ path exists (NVFP4's per-tensor scale needs two passes)
RESQ_KERNELS = (0, 1, 3)
#: largest n:m group the fused path handles
RESQ_MAX_GROUP = 64


def resq_rows(kernel_id: int, rows: torch.Tensor, keep: int, group: int) -> torch.Tensor | None:
    """Fused Rollout-ResQ activation ``Q(x) + S_{keep:group}(Q(x - Q(x)))`` (group 0: dense).

    Returns None where no fused path applies; the caller then composes the steps.
    """
    if (rows.device.type != "cpu" or rows.dtype != torch.float32 or kernel_id not in
            RESQ_KERNELS or group > RESQ_MAX_GROUP):
        return None
    return resq_rows_cpu(kernel_id, rows.contiguous(), keep, group)


__all__ = ["quantize_rows", "resq_rows"]
