"""Format registry: names to format objects, and the top-level ``quantize``."""

from __future__ import annotations

from typing import Any

import torch

from fp4rl.formats.base import FormatError, NumberFormat
from fp4rl.formats.bf16 import BF16
from fp4rl.formats.hif4 import HiF4
from fp4rl.formats.mxfp4 import MXFP4
from fp4rl.formats.mxfp8 import MXFP8
from fp4rl.formats.nvfp4 import NVFP4

_FORMATS: dict[str, NumberFormat] = {f.name: f for f in (HiF4(), MXFP4(), NVFP4(), MXFP8(),
                                                         BF16())}


def list_formats() -> list[str]:
    """Names accepted by :func:`get_format` and :func:`quantize`."""
    return list(_FORMATS)


def get_format(name: str | NumberFormat) -> NumberFormat:
    """The format object for ``name`` (case-insensitive); a format object passes through."""
    if isinstance(name, NumberFormat):
        return name
    if not isinstance(name, str):
        raise FormatError(f"format must be a name, got {type(name).__name__}")
    try:
        return _FORMATS[name.lower()]
    except KeyError:
        raise FormatError(f"unknown format {name!r}; choose one of: "
                          f"{', '.join(list_formats())}") from None


def quantize(x: torch.Tensor, fmt: str | NumberFormat, dim: int = -1,
             **options: Any) -> torch.Tensor:
    """Fake-quantize ``x`` along ``dim`` in format ``fmt`` (output keeps shape and dtype).

    Options: ``rounding="nearest"|"stochastic"``, ``generator=torch.Generator`` and,
    for nvfp4, ``per_tensor_scale=True|False``.
    """
    return get_format(fmt).quantize(x, dim, **options)
