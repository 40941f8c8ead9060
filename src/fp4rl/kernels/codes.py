"""The codes the kernels branch on, one per format with kernels, declared once here: the C
kernel gets them as ``-DFMT_<NAME>=<code>`` at compile time (:mod:`.cpu`), the Triton
kernels as ``tl.constexpr`` globals (:mod:`.triton_quant`), the formats as members."""

from __future__ import annotations

from enum import IntEnum


class FormatCode(IntEnum):
    """Which format's branch a kernel runs."""

    HIF4 = 0
    MXFP4 = 1
    NVFP4 = 2
    MXFP8 = 3
    NVFP4_4O6 = 4  # NVFP4's elements and scales, each block's scale by Four Over Six
    NVFP4_TILES = 5  # NVFP4 whose block scale covers a 16 x 16 tile (16 rows' blocks)


def c_defines() -> tuple[str, ...]:
    """The compiler flags that give quant.c every code (``-DFMT_HIF4=0``, ...)."""
    return tuple(f"-DFMT_{code.name}={code.value}" for code in FormatCode)


__all__ = ["FormatCode", "c_defines"]
