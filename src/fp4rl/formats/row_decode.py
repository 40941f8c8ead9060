"""Fast decoding of packed 2-D weights: table look-ups in float32 instead of the reference
decoders' integer and float64 arithmetic.

A serving engine that keeps weights as the format's 4-bit codes (``weight_storage:
packed`` in vLLM) decodes them on every forward, so the decode must cost about one pass
over the codes. Every value of these formats is a small-mantissa number times a power of
two: the element table times the block scale(s) is exact in float32, so the product of
looked-up factors is the reference's value bit for bit (tests compare against
``get_format(name).decode`` on every code, NaN blocks included). The look-ups are
the formats' own (:meth:`fp4rl.formats.base.BlockFormat.table_decode`, on tables from
:mod:`fp4rl.formats.tables` read on the codes' device); formats without them decode
through their reference.
"""

from __future__ import annotations

import torch

from fp4rl.formats.base import BlockFormat
from fp4rl.formats.packing import PackedTensor
from fp4rl.formats.registry import get_format
from fp4rl.kernels import decode_rows as kernel_decode


def decode_rows(packed: PackedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``get_format(packed.format).decode(packed)`` for a 2-D tensor packed along its rows,
    in float32 (then ``dtype``), bit for bit: by a kernel where one decodes the format on
    the fields' device (Triton on a GPU, straight into ``dtype``), else through the
    format's table look-ups (:meth:`BlockFormat.table_decode`) where it has them."""
    fmt = get_format(packed.format)
    if not isinstance(fmt, BlockFormat) or len(packed.shape) != 2 or packed.dim != 1 or \
            packed.format != fmt.name:
        return fmt.decode(packed).float().to(dtype)
    rows, length = packed.shape
    scaled = packed.tensor_scale is not None
    fields = {k: v.reshape(rows, -1) for k, v in packed.fields.items()}
    values = kernel_decode(fmt, fields, rows, length, torch.float32 if scaled else dtype)
    if values is None:
        blocks = fmt.table_decode(packed.fields)
        if blocks is None:
            return fmt.decode(packed).float().to(dtype)
        values = blocks.reshape(rows, -1)[:, :length]
    if scaled:
        assert packed.tensor_scale is not None  # what ``scaled`` says
        values = values * packed.tensor_scale
    return values.to(dtype)


__all__ = ["decode_rows"]
