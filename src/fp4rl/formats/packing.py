"""Bit packing: two 4-bit codes per byte, and little bit-fields per block.

The packed layout is what real FP4 storage costs; ``PackedTensor.nbytes``
is measured on these buffers, never computed from a formula.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in ``[0, 16)`` pairwise along the last axis (low nibble first)."""
    if codes.shape[-1] % 2:
        raise ValueError("pack_nibbles needs an even number of codes along the last axis")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack 0/1 values along the last axis (a multiple of 8) into bytes, bit i of byte = item i."""
    if bits.shape[-1] % 8:
        raise ValueError("pack_bits needs a multiple of 8 bits along the last axis")
    b: torch.Tensor = bits.to(torch.uint8).unflatten(-1, (-1, 8))
    weights = 1 << torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (b * weights).sum(dim=-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 0/1 values, eight per byte."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


@dataclass
class PackedTensor:
    """A tensor stored in a block format: real 4-bit (or 8-bit) codes plus scale fields.

    ``fields`` maps field names to uint8 buffers (for instance ``codes`` with two
    elements per byte, ``scale`` with one E6M2/E8M0/E4M3 byte per block). ``shape``,
    ``dim`` and ``dtype`` describe the tensor ``decode`` rebuilds; ``tensor_scale`` is
    NVFP4's optional FP32 per-tensor scale, a 0-dim tensor on the fields' device (kept
    there: reading it back to the host would stall a GPU stream and break a CUDA graph).
    """

    format: str
    shape: tuple[int, ...]
    dim: int
    dtype: torch.dtype
    fields: dict[str, torch.Tensor]
    tensor_scale: torch.Tensor | None = None
    options: dict[str, object] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes held by the block payload (codes and scale fields)."""
        return sum(t.numel() * t.element_size() for t in self.fields.values())

    @property
    def metadata_nbytes(self) -> int:
        """Bytes of per-tensor metadata outside the blocks (NVFP4's FP32 scale)."""
        return 4 if self.tensor_scale is not None else 0
