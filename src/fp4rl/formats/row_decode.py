"""Fast decoding of packed 2-D weights: table look-ups in float32 instead of the reference
decoders' integer and float64 arithmetic.

A serving engine that keeps weights as the format's 4-bit codes (``weight_storage:
packed`` in vLLM) decodes them on every forward, so the decode must cost about one pass
over the codes. Every value of these formats is a small-mantissa number times a power of
two: the element table times the block scale(s) is exact in float32, so the product of
looked-up factors is the reference's value bit for bit (tests compare against
``get_format(name).decode`` on every code, NaN blocks included). The tables are the
formats' own (:mod:`fp4rl.formats.tables`), read on the codes' device. Formats without a
table here decode through their reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp4rl.formats import get_format, hif4
from fp4rl.formats.mxfp4 import E2M1_SIGNED, E8M0_SCALES
from fp4rl.formats.nvfp4 import E4M3_SCALES
from fp4rl.formats.packing import PackedTensor, unpack_bits, unpack_nibbles
from fp4rl.formats.tables import DeviceTable
from fp4rl.kernels import decode_rows as kernel_decode


def _hif4(fields: dict[str, torch.Tensor]) -> torch.Tensor:
    """Element ``m4 * 2^(d8 + d16 - 2) * s``: one factor per group of 4 (its level-2 bit
    covers 8 values, its level-3 bit 4), broadcast over the group's elements."""
    blocks = fields["scale"].shape[0]
    elements = hif4.ELEMENTS[unpack_nibbles(fields["codes"]).long()].view(blocks, 16, 4)
    d = (unpack_bits(fields["level2"].unsqueeze(-1)).repeat_interleave(2, -1)
         + unpack_bits(fields["level3"]))
    factor = hif4.QUARTERS[d.long()] * hif4.SCALES[fields["scale"].long()].unsqueeze(-1)
    return (elements * factor.unsqueeze(-1)).view(blocks, 64)


def _e2m1(scales: DeviceTable) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    def decode(fields: dict[str, torch.Tensor]) -> torch.Tensor:
        elements = E2M1_SIGNED[unpack_nibbles(fields["codes"]).long()]
        return elements * scales[fields["scale"].long()].unsqueeze(-1)

    return decode


_BLOCKS: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]] = {
    "hif4": _hif4, "mxfp4": _e2m1(E8M0_SCALES), "nvfp4": _e2m1(E4M3_SCALES)}


def decode_rows(packed: PackedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``get_format(packed.format).decode(packed)`` for a 2-D tensor packed along its rows,
    in float32 (then ``dtype``), bit for bit: by a kernel where one decodes the format on
    the fields' device (Triton on a GPU, straight into ``dtype``), else through table
    look-ups where the format has them."""
    block = _BLOCKS.get(packed.format)
    if block is None or len(packed.shape) != 2 or packed.dim != 1 or \
            packed.format != get_format(packed.format).name:
        return get_format(packed.format).decode(packed).float().to(dtype)
    rows, length = packed.shape
    scaled = packed.tensor_scale is not None
    fields = {k: v.reshape(rows, -1) for k, v in packed.fields.items()}
    values = kernel_decode(packed.format, fields, rows, length,
                           torch.float32 if scaled else dtype)
    if values is None:
        values = block(packed.fields).reshape(rows, -1)[:, :length]
    if scaled:
        values = values * packed.tensor_scale
    return values.to(dtype)


__all__ = ["decode_rows"]
