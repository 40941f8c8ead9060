"""Fast decoding of packed 2-D weights: table look-ups in float32 instead of the reference
decoders' integer and float64 arithmetic.

A serving engine that keeps weights as the format's 4-bit codes (``weight_storage:
packed`` in vLLM) decodes them on every forward, so the decode must cost about one pass
over the codes. Every value of these formats is a small-mantissa number times a power of
two: the element table times the block scale(s) is exact in float32, so the product of
looked-up factors is the reference's value bit for bit (tests compare against
``get_format(name).decode`` on every code, NaN blocks included). Formats without a table
here decode through their reference.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from fp4rl.formats import get_format
from fp4rl.formats.packing import PackedTensor, unpack_bits, unpack_nibbles


@cache
def _signed(magnitudes: tuple[float, ...]) -> torch.Tensor:
    """Element table of 4-bit codes: bit 3 the sign, bits 0-2 an index into magnitudes."""
    mags = torch.tensor(magnitudes, dtype=torch.float32)
    return torch.cat([mags, -mags])


@cache
def _hif4_scales() -> torch.Tensor:
    code = torch.arange(256)
    s = (4 + (code & 3)).double() * torch.pow(2.0, ((code >> 2) - 50).double())
    return torch.where(code == 0xFF, torch.nan, s).float()


@cache
def _e8m0_scales() -> torch.Tensor:
    code = torch.arange(256)
    return torch.where(code == 0xFF, torch.nan, torch.pow(2.0, (code - 127).double())).float()


@cache
def _e4m3_scales() -> torch.Tensor:
    code = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    values = code.view(torch.float8_e4m3fn).float()
    return torch.where((code & 0x7F) == 0x7F, torch.nan, values)


def _hif4(fields: dict[str, torch.Tensor]) -> torch.Tensor:
    """Element ``m4 * 2^(d8 + d16 - 2) * s``: one factor per group of 4 (its level-2 bit
    covers 8 values, its level-3 bit 4), broadcast over the group's elements."""
    blocks = fields["scale"].shape[0]
    elements = _signed((0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0))[
        unpack_nibbles(fields["codes"]).long()].view(blocks, 16, 4)
    d = (unpack_bits(fields["level2"].unsqueeze(-1)).repeat_interleave(2, -1)
         + unpack_bits(fields["level3"]))
    factor = (torch.tensor([0.25, 0.5, 1.0])[d.long()]
              * _hif4_scales()[fields["scale"].long()].unsqueeze(-1))
    return (elements * factor.unsqueeze(-1)).view(blocks, 64)


def _e2m1(scales: Callable[[], torch.Tensor]) -> Callable[[dict[str, torch.Tensor]],
                                                         torch.Tensor]:
    def decode(fields: dict[str, torch.Tensor]) -> torch.Tensor:
        elements = _signed((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))[
            unpack_nibbles(fields["codes"]).long()]
        return elements * scales()[fields["scale"].long()].unsqueeze(-1)

    return decode


_BLOCKS: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]] = {
    "hif4": _hif4, "mxfp4": _e2m1(_e8m0_scales), "nvfp4": _e2m1(_e4m3_scales)}


def decode_rows(packed: PackedTensor) -> torch.Tensor:
    """``get_format(packed.format).decode(packed)`` for a 2-D tensor packed along its rows,
    in float32, bit for bit; through table look-ups where the format has them."""
    block = _BLOCKS.get(packed.format)
    if block is None or len(packed.shape) != 2 or packed.dim != 1 or \
            packed.format != get_format(packed.format).name:
        return get_format(packed.format).decode(packed).float()
    rows, length = packed.shape
    values = block(packed.fields).reshape(rows, -1)[:, :length]
    if packed.tensor_scale is not None:
        values = values * torch.tensor(packed.tensor_scale, dtype=torch.float32)
    return values


__all__ = ["decode_rows"]
