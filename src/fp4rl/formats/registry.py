"""Format registry: names to format objects, and the top-level ``quantize``.

Formats are plug-ins: the built-in ones register through :func:`register_format` like
any other, so a format defined outside the package is found by name the same way; it
quantizes through its reference path, as no kernel knows it.
"""

from __future__ import annotations

from typing import Any

import torch

from fp4rl.errors import did_you_mean
from fp4rl.formats.base import FormatError, NumberFormat
from fp4rl.formats.bf16 import BF16
from fp4rl.formats.hif4 import HiF4
from fp4rl.formats.mxfp4 import MXFP4
from fp4rl.formats.mxfp8 import MXFP8
from fp4rl.formats.nvfp4 import NVFP4

_FORMATS: dict[str, NumberFormat] = {}


def register_format(fmt: NumberFormat, *, replace: bool = False) -> NumberFormat:
    """Make ``fmt`` available under ``fmt.name`` (case-insensitive) and return it.

    A name already taken is refused unless ``replace``: silently swapping a format
    would change every recipe and result that names it.
    """
    if not isinstance(fmt, NumberFormat):
        got = (f"the class {fmt.__name__} (register an instance)" if isinstance(fmt, type)
               else type(fmt).__name__)
        raise FormatError(f"register_format expects a NumberFormat object, got {got}")
    name = getattr(fmt, "name", None)
    if not isinstance(name, str) or not name.strip():
        raise FormatError(f"{type(fmt).__name__}.name must be a non-empty string, got {name!r}")
    key = name.lower()
    if key in _FORMATS and not replace:
        raise FormatError(f"format {key!r} is already registered ({_FORMATS[key]!r}); "
                          f"pass replace=True to override it")
    _FORMATS[key] = fmt
    return fmt


def list_formats() -> list[str]:
    """Names accepted by :func:`get_format` and :func:`quantize`, in registration order."""
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
        raise FormatError(f"unknown format {name!r}{did_you_mean(name.lower(), list_formats())}"
                          f"; choose one of: {', '.join(list_formats())}") from None


def quantize(x: torch.Tensor, fmt: str | NumberFormat, dim: int = -1,
             **options: Any) -> torch.Tensor:
    """Fake-quantize ``x`` along ``dim`` in format ``fmt`` (output keeps shape and dtype).

    Options: ``rounding="nearest"|"stochastic"``, ``generator=torch.Generator`` and,
    for nvfp4, ``per_tensor_scale=True|False``.
    """
    return get_format(fmt).quantize(x, dim, **options)


for _builtin in (HiF4(), MXFP4(), NVFP4(), MXFP8(), BF16()):
    register_format(_builtin)
