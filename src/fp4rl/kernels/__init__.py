"""Fast paths behind the format functions: a fused C kernel on CPU.

Every fast path is bit-identical to the float64 reference in :mod:`fp4rl.formats`;
``quantize_rows`` returns None where no fast path applies, and the caller then
uses the reference (which runs on any device).
"""

from __future__ import annotations

import torch

from fp4rl.kernels.cpu import quantize_rows_cpu


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


__all__ = ["quantize_rows"]
