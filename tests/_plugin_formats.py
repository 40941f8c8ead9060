"""A format of the suite's own, registered as a plug-in would be: the formats' registry
tests and the vLLM method's plug-in test both use it."""

from __future__ import annotations

import torch

from fp4rl.formats.mxfp4 import MXFormat
from fp4rl.formats.packing import pack_nibbles, unpack_nibbles


class MXINT4(MXFormat):
    """A toy plug-in: the OCP MX block scale with sign-magnitude integer elements 0..7."""

    name = "mxint4_test"
    bits_per_value = 4.25
    scale_offset = 2  # |x| / 2^E < 8

    def round_elements(self, v: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return torch.floor(v + (0.5 if noise is None else noise)).clamp(max=7.0)

    def element_codes(self, q: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        return pack_nibbles(neg.to(torch.int64) * 8 + q.to(torch.int64))

    def decode_elements(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = unpack_nibbles(codes).to(torch.int64)
        return (c & 7).to(torch.float64), c >= 8
