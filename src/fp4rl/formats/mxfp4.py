"""MXFP4 (OCP Microscaling v1.0): 32-value blocks, E8M0 scale, E2M1 elements.

Also home of the E2M1 element grid that NVFP4 shares.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from fp4rl.formats._exact import floor_log2, pow2, round_minifloat
from fp4rl.formats.base import BlockFormat
from fp4rl.formats.packing import pack_nibbles, unpack_nibbles
from fp4rl.formats.tables import DeviceTable, signed_table
from fp4rl.kernels import QUANTIZE_AND_RESQ, FormatKernels, Operation
from fp4rl.kernels.codes import FormatCode

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = DeviceTable(lambda: torch.tensor(E2M1_GRID, dtype=torch.float64))
#: float32 values of the signed 4-bit E2M1 codes (sign in bit 3)
E2M1_SIGNED = signed_table(E2M1_GRID)
E8M0_NAN = 0xFF


def _e2m1_index() -> torch.Tensor:
    """Index of each magnitude on the E2M1 grid, looked up by 2 * value (0 .. 12)."""
    index = torch.zeros(13, dtype=torch.int64)
    index[(2 * torch.tensor(E2M1_GRID)).to(torch.int64)] = torch.arange(8)
    return index


_E2M1_INDEX = DeviceTable(_e2m1_index)


def _e8m0_scales() -> torch.Tensor:
    code = torch.arange(256)
    return torch.where(code == E8M0_NAN, torch.nan, torch.pow(2.0, (code - 127).double())).float()


#: float32 value of each E8M0 scale byte (0xFF: NaN)
E8M0_SCALES = DeviceTable(_e8m0_scales)


def e2m1_round(v: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """Round magnitudes onto the E2M1 grid (ties to even, or stochastic), clamp at 6."""
    return round_minifloat(v, 1, min_exp=0, max_value=6.0, noise=noise)


def e2m1_codes(q: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """4-bit codes (sign bit 3, grid index bits 0-2) of E2M1 magnitudes ``q``."""
    return neg.to(torch.int64) * 8 + _E2M1_INDEX[(2 * q).to(torch.int64)]


def e2m1_decode(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitudes and sign mask from 4-bit E2M1 codes."""
    codes = codes.to(torch.int64)
    return E2M1_VALUES[codes & 7], codes >= 8


def e2m1_magnitude_codes(m: torch.Tensor) -> torch.Tensor:
    """Grid indices 0-7 of E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 (float32), by
    arithmetic rather than a look-up, for the fast encoder."""
    m = torch.where(m <= 2, 2 * m, torch.where(m <= 4, m + 2, 7.0))
    return m.round_().to(torch.uint8)


def e2m1_table_decode(buffers: dict[str, torch.Tensor], scales: DeviceTable) -> torch.Tensor:
    """Float32 values of E2M1 blocks with one byte scale each, ``scales`` giving each scale
    byte's value (NaN codes: NaN)."""
    elements = E2M1_SIGNED[unpack_nibbles(buffers["codes"]).long()]
    return elements * scales[buffers["scale"].long()].unsqueeze(-1)


def shared_exponent(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """OCP MX shared exponent ``floor(log2 amax) - offset``, clamped at -127 (zero blocks too)."""
    amax = blocks.abs().amax(-1, keepdim=True)
    e = floor_log2(torch.where(amax > 0, amax, torch.ones_like(amax))) - offset
    return torch.where(amax > 0, e, -127).clamp(min=-127)


class MXFormat(BlockFormat):
    """OCP MX: 32 values share an E8M0 exponent ``floor(log2 amax) - scale_offset``.

    Subclasses choose the element grid: how magnitudes round onto it and how a
    (magnitude, sign) pair is stored as element codes.
    """

    block_size = 32
    scale_offset: int

    @abstractmethod
    def round_elements(self, v: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """Magnitudes ``v = |x| / 2^E`` rounded onto the element grid."""

    @abstractmethod
    def element_codes(self, q: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        """Packed uint8 storage of the signed elements."""

    @abstractmethod
    def decode_elements(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Magnitudes and sign mask back from the element storage."""

    def fields(self, blocks: torch.Tensor, noise: torch.Tensor | None) -> dict[str, torch.Tensor]:
        e = shared_exponent(blocks, self.scale_offset)
        q = self.round_elements(blocks.abs() * pow2(-e), noise)
        return {"exponent": e, "q": q, "neg": torch.signbit(blocks)}

    def assemble(self, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        mag = fields["q"] * pow2(fields["exponent"])
        return torch.where(fields["neg"], -mag, mag)

    def pack(self, fields: dict[str, torch.Tensor], nan: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = torch.where(nan, E8M0_NAN, fields["exponent"].squeeze(-1) + 127)
        return {"scale": scale.to(torch.uint8),
                "codes": self.element_codes(fields["q"], fields["neg"])}

    def unpack(self, buffers: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                               torch.Tensor]:
        scale = buffers["scale"].to(torch.int64)
        q, neg = self.decode_elements(buffers["codes"])
        return {"exponent": (scale - 127).unsqueeze(-1), "q": q, "neg": neg}, scale == E8M0_NAN


class MXFP4(MXFormat):
    name = "mxfp4"
    bits_per_value = 4.25
    #: the C kernel runs every block pass; Triton also decodes packed weights
    #: and multiplies by them
    kernels = FormatKernels(FormatCode.MXFP4, c=QUANTIZE_AND_RESQ | {Operation.ROWS_BF16,
                                                                   Operation.BOTH},
                            triton=QUANTIZE_AND_RESQ | {Operation.ROWS_BF16, Operation.DECODE,
                                                        Operation.PACKED_MM, Operation.BOTH,
                                                        Operation.QMM})
    scale_offset = 2  # E2M1's largest exponent

    def round_elements(self, v: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return e2m1_round(v, noise)

    def element_codes(self, q: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        return pack_nibbles(e2m1_codes(q, neg))

    def decode_elements(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return e2m1_decode(unpack_nibbles(codes))

    def table_decode(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        return e2m1_table_decode(buffers, E8M0_SCALES)

    def block_scales(self, blocks: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        e = shared_exponent(blocks.abs().amax(-1, keepdim=True).double(), self.scale_offset)
        empty = blocks[:, :0]
        fields = {"exponent": e, "q": empty.double(), "neg": empty.bool()}
        return fields, pow2(e).float().unsqueeze(-1)

    def magnitude_codes(self, m: torch.Tensor) -> torch.Tensor:
        return e2m1_magnitude_codes(m)
