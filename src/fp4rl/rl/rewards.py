"""Verifiable rewards for math problems: 1.0 for a correct final answer, else 0.0.

Two graders cover the supported data:

* ``gsm8k`` compares one number. The reference is a GSM8K answer (``"... #### 72"``) or a
  bare number; the completion's answer is, in order of preference, the content of its last
  ``\\boxed{...}``, the first number after its last ``####``, or its last number.
* ``math`` hands both sides to ``math_verify``, which understands LaTeX (fractions, roots,
  intervals, sets, ...). The reference may be a bare answer or a full solution with ``\\boxed``.

Rewards run inside rollout workers, so no grader may raise: a ``None``, empty or malformed
completion scores 0.0. ``math_verify``'s own timeouts rely on ``SIGALRM``, which only works in
the main thread, so they are switched off; instead, expressions that sympy could take minutes
to evaluate (power towers, huge factorials, high powers of polynomials) are rejected before
comparison and score 0.0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from decimal import Decimal
from functools import lru_cache
from typing import Any

from math_verify import parse, verify
from sympy import Basic, MatrixBase, Pow, gamma, preorder_traversal
from sympy.functions.combinatorial.factorials import CombinatorialFunction

RewardFn = Callable[[str | None, str], float]
"""A reward maps ``(completion, reference)`` to 1.0 (correct) or 0.0."""

# A number as people write it: optional sign (ASCII or Unicode minus) and "$", thousands
# separators, decimals. The lookbehind keeps "3-5" from reading as -5 and "v1.2" as 1.2.
_NUMBER = re.compile(r"(?<![\w.])([-\u2212]?)\$?(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?")
_BOX_OPENERS = ("\\boxed{", "\\fbox{")
_GSM8K_MARKER = "####"

# Completions can be long; answers sit at the end, and bounding the text handed to the
# LaTeX parser bounds its work.
_MAX_MATH_CHARS = 4_000
# Limits that keep sympy's comparison well under a second (measured: 3**5_000_000 takes
# 1.6 s, (x + y + 1)**50 takes 4 s to expand, 123456789**123456789 does not finish).
_MAX_POWER_BITS = 1_000_000
_MAX_SYMBOLIC_EXPONENT = 24
_MAX_COMBINATORIAL_ARG = 10_000


# --------------------------------------------------------------------------- GSM8K style


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
    _, found, tail = text.rpartition(_GSM8K_MARKER)
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


def gsm8k_reward(completion: str | None, reference: str) -> float:
    """1.0 when the completion's number equals the reference number, else 0.0."""
    if not isinstance(completion, str) or not isinstance(reference, str):
        return 0.0
    expected = gsm8k_reference_value(reference)
    answer = extract_gsm8k_answer(completion)
    return float(expected is not None and answer is not None and answer == expected)


# --------------------------------------------------------------------------- MATH style


def _magnitude(expr: Basic) -> float:
    """Absolute value of a numeric expression, ``inf`` if it cannot be bounded cheaply."""
    try:
        return abs(complex(expr.evalf(15)))
    except (TypeError, ValueError, OverflowError, ArithmeticError):
        return math.inf


def _power_explodes(base: Basic, exponent: Basic) -> bool:
    if not exponent.is_number:
        return False
    size = _magnitude(exponent)
    if base.is_number:
        return size * math.log2(max(_magnitude(base), 2.0)) > _MAX_POWER_BITS
    return size > _MAX_SYMBOLIC_EXPONENT


def _explodes(node: Basic) -> bool:
    if isinstance(node, Pow):
        return _power_explodes(node.base, node.exp)
    if isinstance(node, CombinatorialFunction | gamma):
        return any(_magnitude(arg) > _MAX_COMBINATORIAL_ARG for arg in node.args if arg.is_number)
    return False


def _is_tractable(item: Any) -> bool:
    """Whether sympy can compare ``item`` quickly (strings always can)."""
    if isinstance(item, MatrixBase):
        return all(_is_tractable(element) for element in item)
    if isinstance(item, Basic):
        return not any(_explodes(node) for node in preorder_traversal(item))
    return True


def _parse_math(text: str) -> tuple[Any, ...]:
    """``math_verify.parse`` without its signal-based timeout; () if nothing is usable."""
    parsed = tuple(parse(text, parsing_timeout=None))
    return parsed if parsed and all(_is_tractable(item) for item in parsed) else ()


@lru_cache(maxsize=4096)
def _parse_reference(reference: str) -> tuple[Any, ...]:
    """Parse a reference once: GRPO scores many completions against the same one."""
    text = reference if "\\boxed" in reference else f"\\boxed{{{reference}}}"
    return _parse_math(text)


def math_reward(completion: str | None, reference: str) -> float:
    """1.0 when ``math_verify`` finds the completion's answer equal to the reference."""
    if not isinstance(completion, str) or not isinstance(reference, str):
        return 0.0
    if not completion.strip() or not reference.strip():
        return 0.0
    try:
        gold = _parse_reference(reference.strip())
        answer = _parse_math(completion[-_MAX_MATH_CHARS:]) if gold else ()
        return float(bool(answer) and verify(list(gold), list(answer), timeout_seconds=None))
    except Exception:
        # math_verify and sympy raise many exception types on odd input; any of them
        # means the answer could not be confirmed.
        return 0.0


# --------------------------------------------------------------------------- registry


def auto_reward(completion: str | None, reference: str) -> float:
    """Grade GSM8K-style references (they contain ``####``) numerically, others with math."""
    if isinstance(reference, str) and _GSM8K_MARKER in reference:
        return gsm8k_reward(completion, reference)
    return math_reward(completion, reference)


_REWARDS: dict[str, RewardFn] = {
    "auto": auto_reward,
    "gsm8k": gsm8k_reward,
    "math": math_reward,
}


def register_reward(name: str, fn: RewardFn) -> None:
    """Add a verifiable reward under ``name`` (usable as ``data.reward`` in a config).

    ``fn(completion, reference)`` must return 1.0 or 0.0 and never raise.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("a reward needs a non-empty name")
    _REWARDS[name] = fn


def reward_names() -> tuple[str, ...]:
    """Names accepted by :func:`get_reward_fn`."""
    return tuple(sorted(_REWARDS))


def get_reward_fn(name: str) -> RewardFn:
    """Look up a reward by name; an unknown name raises ``ValueError`` listing the choices."""
    try:
        return _REWARDS[name]
    except (KeyError, TypeError):
        choices = ", ".join(reward_names())
        raise ValueError(f"unknown reward {name!r}; choose one of: {choices}") from None
