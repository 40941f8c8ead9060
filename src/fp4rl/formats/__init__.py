"""Bit-exact 4-bit (and 8-bit) number formats: HiF4, MXFP4, NVFP4, MXFP8 E4M3, bf16.

The numeric contract is ``docs/formats.md``; each format lives in its own module, and
more register with :func:`register_format`.
"""

from fp4rl.formats.base import BlockFormat, FormatError, NumberFormat, Rounding
from fp4rl.formats.packing import PackedTensor
from fp4rl.formats.registry import get_format, list_formats, quantize, register_format

__all__ = ["BlockFormat", "FormatError", "NumberFormat", "PackedTensor", "Rounding",
           "get_format", "list_formats", "quantize", "register_format"]
