"""Exact float64 arithmetic helpers for the reference quantizers.

Every value the formats produce has at most a few significant bits, and every
intermediate named by the spec (``|x| * r``, ``vmax * c``) fits in the 53-bit
float64 mantissa, so float64 evaluates the rules of ``formats.md`` exactly.
``floor(log2 v)`` is taken from ``frexp`` rather than ``log2`` because a
rounded logarithm can land on the wrong side of an integer.
"""

from __future__ import annotations

import torch


def floor_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact ``floor(log2 v)`` for positive float64 values (garbage for 0, mask it)."""
    _, exponent = torch.frexp(v)
    return exponent.to(torch.int64) - 1


def pow2(e: torch.Tensor | int) -> torch.Tensor:
    """``2**e`` as float64 (exact for the exponent ranges used here)."""
    if isinstance(e, int):
        return torch.tensor(2.0**e, dtype=torch.float64)
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float64, device=e.device), e)


def round_minifloat(v: torch.Tensor, mantissa_bits: int, min_exp: int = -1022,
                    max_value: float = float("inf"),
                    noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round non-negative float64 ``v`` onto a minifloat grid, saturating at ``max_value``.

    The grid has ``mantissa_bits`` fraction bits; ``min_exp`` is its smallest normal
    exponent, below which the spacing stays fixed (subnormals). With ``noise`` (uniform
    in [0, 1)) the rounding is stochastic, ``floor(v / step + u) * step``, which is
    unbiased between grid points; without it, nearest with ties to even.
    """
    e = torch.clamp(floor_log2(torch.where(v > 0, v, torch.ones_like(v))), min=min_exp)
    step = pow2(e - mantissa_bits)
    scaled = v / step
    q = torch.round(scaled) if noise is None else torch.floor(scaled + noise)
    return torch.clamp(q * step, max=max_value)


def divide(x: torch.Tensor, c: float) -> torch.Tensor:
    """``x / c``, correctly rounded on every device. CUDA divides a tensor by a Python
    number as a product with its reciprocal, which can differ from the quotient in the
    last bit; a divisor on the tensor's own device is divided by (a fill, no host copy,
    so a CUDA graph captures it)."""
    return x / torch.full((), c, dtype=x.dtype, device=x.device)


def bf16_round(v: torch.Tensor) -> torch.Tensor:
    """Round non-negative float64 values to the nearest bfloat16 value (8 significant bits)."""
    return round_minifloat(v, 7, min_exp=-126)


def nonfinite_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Boolean ``(N, 1)`` mask of blocks holding a NaN or an Inf."""
    return (~torch.isfinite(blocks)).any(dim=-1, keepdim=True)
