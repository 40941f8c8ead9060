"""``bf16``: round to bfloat16 and back, the "unquantized" baseline of every recipe.

Element-wise (no blocks): NaN stays NaN and Inf stays Inf, as in a real bf16 GEMM.
Stochastic rounding adds 16 uniform random bits below the bf16 mantissa before
truncating, the usual unbiased scheme for low-precision gradient accumulation.
"""

from __future__ import annotations

from typing import Unpack

import torch

from fp4rl.formats._exact import bf16_round
from fp4rl.formats.base import (
    NumberFormat,
    QuantizeKwargs,
    QuantOptions,
    Rounding,
    check_tensor,
)
from fp4rl.formats.packing import PackedTensor


class BF16(NumberFormat):
    name = "bf16"
    block_size = 1
    bits_per_value = 16.0

    def quantize(self, x: torch.Tensor, dim: int = -1,
                 **options: Unpack[QuantizeKwargs]) -> torch.Tensor:
        opts = self.options(**options)
        check_tensor(x, dim)
        if opts.rounding is Rounding.STOCHASTIC:
            return _stochastic_bf16(x, opts).to(x.dtype)
        return x.to(torch.bfloat16).to(x.dtype)

    def quantize_reference(self, x: torch.Tensor, dim: int = -1,
                           **options: Unpack[QuantizeKwargs]) -> torch.Tensor:
        opts = self.options(**options)
        check_tensor(x, dim)
        if opts.rounding is Rounding.STOCHASTIC:
            return _stochastic_bf16(x, opts).to(x.dtype)
        v = x.to(torch.float64)
        rounded = bf16_round(v.abs().nan_to_num(posinf=0.0))
        rounded = torch.where(rounded >= 2.0**128, torch.inf, rounded)  # overflow to Inf
        out = torch.where(torch.isfinite(v), torch.copysign(rounded, v), v)
        return out.to(x.dtype)

    def encode(self, x: torch.Tensor, dim: int = -1,
               **options: Unpack[QuantizeKwargs]) -> PackedTensor:
        d = check_tensor(x, dim)
        raw = self.quantize(x, dim, **options).to(torch.bfloat16).contiguous()
        return PackedTensor(self.name, tuple(x.shape), d, x.dtype,
                            {"bits": raw.reshape(-1).view(torch.uint8)})

    def decode(self, packed: PackedTensor) -> torch.Tensor:
        values = packed.fields["bits"].view(torch.bfloat16).reshape(packed.shape)
        return values.to(packed.dtype)


def _stochastic_bf16(x: torch.Tensor, opts: QuantOptions) -> torch.Tensor:
    """Add uniform noise below the bf16 mantissa, then truncate (non-finite values kept)."""
    f = x.to(torch.float32).contiguous()
    bits = f.view(torch.int32)
    noise = torch.randint(0, 1 << 16, f.shape, generator=opts.generator, dtype=torch.int32,
                          device=f.device)
    rounded = ((bits + noise) & ~0xFFFF).view(torch.float32)
    return torch.where(torch.isfinite(f), rounded, f.to(torch.bfloat16).to(torch.float32))
