"""Reading final answers out of free text: numbers, ``\\boxed{}`` and GSM8K's ``####``.

Shared by the dataset layouts (to canonicalize GSM8K references) and the rewards (to
grade completions), so both read a number the same way.
"""

from __future__ import annotations

import re
from decimal import Decimal

# A number as people write it: optional sign (ASCII or Unicode minus) and "$", thousands
# separators, decimals. The lookbehind keeps "3-5" from reading as -5 and "v1.2" as 1.2.
_NUMBER = re.compile(r"(?<![\w.])([-\u2212]?)\$?(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?")
_BOX_OPENERS = ("\\boxed{", "\\fbox{")
GSM8K_MARKER = "####"


def _to_decimal(match: re.Match[str]) -> Decimal:
    """Turn one ``_NUMBER`` match into an exact value (commas and "$" dropped)."""
    sign, digits, fraction = match.groups()
    return Decimal(("-" if sign else "") + digits.replace(",", "") + (fraction or ""))


def _first_number(text: str) -> Decimal | None:
    match = _NUMBER.search(text)
    return _to_decimal(match) if match else None


def _last_number(text: str) -> Decimal | None:
    matches = list(_NUMBER.finditer(text))
    return _to_decimal(matches[-1]) if matches else None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced.

    Returns ``None`` when there is no box or the last one is never closed (a truncated
    completion), so callers can fall back to other answer markers.
    """
    position, opener = max((text.rfind(candidate), candidate) for candidate in _BOX_OPENERS)
    if position < 0:
        return None
    start = position + len(opener)
    depth = 1
    for pos in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            return text[start:pos]
    return None


def _boxed_number(content: str) -> Decimal | None:
    """The number a boxed GSM8K answer states: after the last "=", the first number.

    ``x = 5`` gives 5 and ``5 \\text{ cm}^2`` gives 5, not the exponent.
    """
    return _first_number(content.rsplit("=", 1)[-1])


def _after_marker(text: str) -> str | None:
    _, found, tail = text.rpartition(GSM8K_MARKER)
    return tail if found else None


def extract_gsm8k_answer(completion: str) -> Decimal | None:
    """The numeric answer a completion commits to, or ``None`` if it states none."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return _boxed_number(boxed)
    tail = _after_marker(completion)
    if tail is not None and (number := _first_number(tail)) is not None:
        return number
    return _last_number(completion)


def gsm8k_reference_value(reference: str) -> Decimal | None:
    """The number in a GSM8K reference: the first after the last ``####``, else the first."""
    tail = _after_marker(reference)
    return _first_number(reference if tail is None else tail)
