"""Format registry: names to format objects, and the top-level ``quantize``.

Formats are plug-ins: the built-in ones register through :func:`register_format` like
any other, so a format defined outside the package is found by name the same way; it
quantizes through its reference path, as no kernel knows it.
"""

from __future__ import annotations

import copyreg
from typing import Any, Unpack

import torch

from fp4rl.formats.base import FormatError, NumberFormat, QuantizeKwargs
from fp4rl.formats.bf16 import BF16
from fp4rl.formats.hif4 import HiF4
from fp4rl.formats.mxfp4 import MXFP4
from fp4rl.formats.mxfp8 import MXFP8
from fp4rl.formats.nvfp4 import (
    NVFP4,
    NVFP4FourOverSix,
    NVFP4PerToken,
    NVFP4PerTokenFourOverSix,
    NVFP4Tiles,
    ScaleRule,
    scale_rule_name,
    scale_variants,
)
from fp4rl.registry import Registry

_FORMATS: Registry[NumberFormat] = Registry("format", FormatError, key=str.lower)


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
    registered = _FORMATS.register(name, fmt, replace=replace)
    copyreg.pickle(type(fmt), _reduce_format)
    return registered


def _reduce_format(fmt: NumberFormat) -> str | tuple[Any, ...]:
    """Pickle a registered format as its name, so that a recipe holds the registered object
    itself after a ``torch.save`` or a hop to a worker process; any other object of a
    registered class (one no registry holds) by value, as pickle would."""
    if fmt.name in _FORMATS and _FORMATS.get(fmt.name) is fmt:
        return get_format, (fmt.name,)
    return object.__reduce_ex__(fmt, 2)


def list_formats() -> list[str]:
    """Names accepted by :func:`get_format` and :func:`quantize`, in registration order."""
    return _FORMATS.names()


def get_format(name: str | NumberFormat) -> NumberFormat:
    """The format object for ``name`` (case-insensitive); a format object passes through."""
    if isinstance(name, NumberFormat):
        return name
    if not isinstance(name, str):
        raise FormatError(f"format must be a name, got {type(name).__name__}")
    return _FORMATS.get(name)


def with_scale_rule(fmt: NumberFormat, rule: ScaleRule) -> NumberFormat | None:
    """``fmt`` with its FP32 scale on top of the blocks under ``rule`` (a
    :class:`~fp4rl.formats.nvfp4.ScaleRule`, read from its spelling at the edge: the
    recipe's ``nvfp4_scale``): the registered format of that
    rule (``nvfp4`` under ``pow2`` is ``nvfp4_pow2``; ``fmt`` itself under its own rule),
    or None where ``fmt`` takes no such rule (it has no such scale, or no variant of it
    under ``rule`` is registered: a per-token scale is never ``static``)."""
    if fmt.scale_rule is None or not isinstance(fmt, NVFP4):
        return None
    name = scale_rule_name(fmt, rule)
    return _FORMATS.get(name) if name in _FORMATS else None


def scale_rules(fmt: NumberFormat) -> list[ScaleRule]:
    """The rules ``fmt``'s FP32 scale on top of the blocks can follow, in
    :class:`~fp4rl.formats.nvfp4.ScaleRule`'s order (none for a format without one): what
    ``nvfp4_scale`` may ask of it."""
    return [rule for rule in ScaleRule if with_scale_rule(fmt, rule) is not None]


def quantize(x: torch.Tensor, fmt: str | NumberFormat, dim: int = -1,
             **options: Unpack[QuantizeKwargs]) -> torch.Tensor:
    """Fake-quantize ``x`` along ``dim`` in format ``fmt`` (output keeps shape and dtype).

    Options: ``rounding="nearest"|"stochastic"``, ``generator=torch.Generator`` and,
    for nvfp4 and nvfp4_per_token, ``per_tensor_scale=True|False`` (the FP32 scale
    on top of the blocks, per tensor or per token).
    """
    return get_format(fmt).quantize(x, dim, **options)


for _builtin in (HiF4(), MXFP4(), NVFP4(), NVFP4PerToken(), NVFP4FourOverSix(),
                 NVFP4PerTokenFourOverSix(), NVFP4Tiles(), MXFP8(), BF16(), *scale_variants()):
    register_format(_builtin)
