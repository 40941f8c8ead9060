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
from collections.abc import Callable
from functools import lru_cache
from typing import overload

from math_verify import parse, verify
from sympy import Basic, MatrixBase, Pow, gamma, preorder_traversal
from sympy.functions.combinatorial.factorials import CombinatorialFunction

from fp4rl.data.answers import GSM8K_MARKER, extract_gsm8k_answer, gsm8k_reference_value
from fp4rl.errors import ConfigError
from fp4rl.registry import Registry

RewardFn = Callable[[str | None, str], float]
"""A reward maps ``(completion, reference)`` to 1.0 (correct) or 0.0."""

# Completions can be long; answers sit at the end, and bounding the text handed to the
# LaTeX parser bounds its work.
_MAX_MATH_CHARS = 4_000
# Limits that keep sympy's comparison well under a second (measured: 3**5_000_000 takes
# 1.6 s, (x + y + 1)**50 takes 4 s to expand, 123456789**123456789 does not finish).
_MAX_POWER_BITS = 1_000_000
_MAX_SYMBOLIC_EXPONENT = 24
_MAX_COMBINATORIAL_ARG = 10_000


# --------------------------------------------------------------------------- GSM8K style


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


def _is_tractable(item: object) -> bool:
    """Whether sympy can compare ``item`` quickly (strings always can)."""
    if isinstance(item, MatrixBase):
        return all(_is_tractable(element) for element in item)
    if isinstance(item, Basic):
        return not any(_explodes(node) for node in preorder_traversal(item))
    return True


def _parse_math(text: str) -> tuple[object, ...]:
    """``math_verify.parse`` without its signal-based timeout; () if nothing is usable."""
    parsed = tuple(parse(text, parsing_timeout=None))
    return parsed if parsed and all(_is_tractable(item) for item in parsed) else ()


@lru_cache(maxsize=4096)
def _parse_reference(reference: str) -> tuple[object, ...]:
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
    if isinstance(reference, str) and GSM8K_MARKER in reference:
        return gsm8k_reward(completion, reference)
    return math_reward(completion, reference)


_REWARDS: Registry[RewardFn] = Registry(
    "reward", ConfigError, hint=" (or register one with fp4rl.rl.rewards.register_reward)")


@overload
def register_reward(name: str, fn: RewardFn, *, replace: bool = False) -> RewardFn: ...


@overload
def register_reward(name: str, fn: None = None, *, replace: bool = False
                    ) -> Callable[[RewardFn], RewardFn]: ...


def register_reward(name: str, fn: RewardFn | None = None, *, replace: bool = False
                    ) -> RewardFn | Callable[[RewardFn], RewardFn]:
    """Add a reward under ``name`` (usable as ``data.reward`` in a config); without ``fn``,
    a decorator that registers the function it decorates.

    ``fn(completion, reference)`` must return 1.0 or 0.0 and never raise. A name already
    taken by another function is refused unless ``replace``: silently swapping a reward
    would change what every config naming it trains on.
    """
    if fn is None:
        return lambda f: register_reward(name, f, replace=replace)
    if not isinstance(name, str) or not name:
        raise ValueError(f"a reward name must be non-empty text, got {name!r}")
    if not callable(fn):
        raise TypeError(f"reward {name!r} must be callable, got {type(fn).__name__}")
    return _REWARDS.register(name, fn, replace=replace)


def list_rewards() -> list[str]:
    """Names accepted by :func:`get_reward`, in registration order."""
    return _REWARDS.names()


def get_reward(name: str) -> RewardFn:
    """Look up a reward by name; an unknown name is a one-line ``ConfigError`` with the
    nearest name and the choices."""
    return _REWARDS.get(name)


for _name, _fn in (("auto", auto_reward), ("gsm8k", gsm8k_reward), ("math", math_reward)):
    register_reward(_name, _fn)

