"""NVFP4: 16-value blocks, E4M3 block scale, E2M1 elements, optional FP32 tensor scale.

The per-tensor scale (on by default, as in NVIDIA's training recipe) maps the
tensor's largest magnitude to the top of the E4M3 x E2M1 range, 6 * 448, so
block scales use E4M3's precision instead of saturating or underflowing.
"""

from __future__ import annotations

from typing import Any

import torch

from fp4rl.formats._exact import round_minifloat
from fp4rl.formats.base import BlockFormat, QuantOptions
from fp4rl.formats.mxfp4 import e2m1_codes, e2m1_decode, e2m1_round
from fp4rl.formats.packing import pack_nibbles, unpack_nibbles

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
TENSOR_RANGE = 6.0 * E4M3_MAX


def e4m3_round(v: torch.Tensor, noise: torch.Tensor | None = None,
               max_value: float = E4M3_MAX) -> torch.Tensor:
    """Round magnitudes onto the FP8 E4M3 grid (subnormals below 2**-6), saturating."""
    return round_minifloat(v, 3, min_exp=-6, max_value=max_value, noise=noise)


def e4m3_bytes(values: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn) byte codes of values already on the E4M3 grid (exact conversion)."""
    return values.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of E4M3 (fn) byte codes."""
    return codes.view(torch.float8_e4m3fn).to(torch.float64)


class NVFP4(BlockFormat):
    name = "nvfp4"
    block_size = 16
    bits_per_value = 4.5
    extra_options = ("per_tensor_scale",)

    def fields(self, blocks: torch.Tensor, noise: torch.Tensor | None) -> dict[str, torch.Tensor]:
        a = blocks.abs()
        s = e4m3_round(torch.clamp(a.amax(-1, keepdim=True) / 6.0, max=E4M3_MAX))
        v = torch.where(s > 0, a / torch.where(s > 0, s, 1.0), 0.0)
        return {"scale": s, "q": e2m1_round(v, noise), "neg": torch.signbit(blocks)}

    def assemble(self, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        mag = fields["q"] * fields["scale"]
        return torch.where(fields["neg"], -mag, mag)

    def pack(self, fields: dict[str, torch.Tensor], nan: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = torch.where(nan, E4M3_NAN, e4m3_bytes(fields["scale"].squeeze(-1)))
        return {"scale": scale.to(torch.uint8),
                "codes": pack_nibbles(e2m1_codes(fields["q"], fields["neg"]))}

    def unpack(self, buffers: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                               torch.Tensor]:
        scale = buffers["scale"]
        nan = (scale & 0x7F) == E4M3_NAN
        q, neg = e2m1_decode(unpack_nibbles(buffers["codes"]))
        s = e4m3_values(torch.where(nan, 0, scale).to(torch.uint8)).unsqueeze(-1)
        return {"scale": s, "q": q, "neg": neg}, nan

    def tensor_scale(self, x: torch.Tensor, **options: Any) -> torch.Tensor | None:
        """``amax / (6 * 448)`` of ``x`` in float32, or None where switched off or zero."""
        return self._tensor_scale(x.float(), self.options(**options))

    def _tensor_scale(self, rows: torch.Tensor, opts: QuantOptions) -> torch.Tensor | None:
        """``g = amax / (6 * 448)`` in FP32 over the finite values, when enabled and non-zero."""
        if not opts.per_tensor_scale:
            return None
        low, high = torch.aminmax(rows)  # one pass, no |x| temporary
        amax = torch.maximum(-low, high)
        if not torch.isfinite(amax):
            finite = rows[torch.isfinite(rows)]
            amax = finite.abs().amax() if finite.numel() else rows.new_zeros(())
        g = amax / TENSOR_RANGE
        return g if 0 < float(g) < float("inf") else None
