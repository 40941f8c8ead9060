"""An independent, scalar, exact-rational reading of formats.md.

Written straight from the spec with Python ``Fraction`` arithmetic, sharing no
code with fp4rl, so that a rule misread in both fp4rl paths still shows up.
"""

from __future__ import annotations

import math
from fractions import Fraction

HALF = Fraction(1, 2)


def floor_log2(v: Fraction) -> int:
    e = v.numerator.bit_length() - v.denominator.bit_length()
    while Fraction(2) ** e > v:
        e -= 1
    while Fraction(2) ** (e + 1) <= v:
        e += 1
    return e


def round_bits(v: Fraction, frac_bits: int, min_exp: int | None = None) -> Fraction:
    """Round v >= 0 to frac_bits fraction bits, ties to even (Python's round is)."""
    if v == 0:
        return Fraction(0)
    e = floor_log2(v)
    if min_exp is not None:
        e = max(e, min_exp)
    step = Fraction(2) ** (e - frac_bits)
    return round(v / step) * step


def _out(x: float, mag: Fraction) -> float:
    return math.copysign(float(mag), x)


def hif4_block(xs: list[float]) -> list[float]:
    a = [abs(Fraction(x)) for x in xs]
    v16 = [max(a[4 * k: 4 * k + 4]) for k in range(16)]
    v8 = [max(v16[2 * j], v16[2 * j + 1]) for j in range(8)]
    c = round_bits(Fraction(1, 7), 7)
    s = round_bits(max(v8) * c, 7)
    s = min(max(s, Fraction(2) ** -48), Fraction(49152))
    s = round_bits(s, 2)
    r = round_bits(1 / s, 7)
    out = []
    for i, x in enumerate(xs):
        d8 = 1 if v8[i // 8] * r >= 4 else 0
        d16 = 1 if v16[i // 4] * r * Fraction(2) ** -d8 >= 2 else 0
        d = d8 + d16
        m = Fraction(math.floor(a[i] * r * Fraction(2) ** -d * 4 + HALF), 4)
        if m >= 2:
            m = Fraction(7, 4)
        out.append(_out(x, m * Fraction(2) ** d * s))
    return out


def _e2m1(v: Fraction) -> Fraction:
    e = max(floor_log2(v), 0) if v > 0 else 0
    q = round(v * Fraction(2) ** (1 - e)) * Fraction(2) ** e / 2
    return min(q, Fraction(6))


def mxfp4_block(xs: list[float]) -> list[float]:
    a = [abs(Fraction(x)) for x in xs]
    amax = max(a)
    if amax == 0:
        return [_out(x, Fraction(0)) for x in xs]
    big_e = max(floor_log2(amax) - 2, -127)
    scale = Fraction(2) ** big_e
    return [_out(x, _e2m1(ai / scale) * scale) for x, ai in zip(xs, a, strict=True)]


def nvfp4_block(xs: list[float]) -> list[float]:
    a = [abs(Fraction(x)) for x in xs]
    s = min(max(a) / 6, Fraction(448))
    s = round_bits(s, 3, min_exp=-6)
    if s == 0:
        return [_out(x, Fraction(0)) for x in xs]
    return [_out(x, _e2m1(ai / s) * s) for x, ai in zip(xs, a, strict=True)]


BLOCKS = {"hif4": (64, hif4_block), "mxfp4": (32, mxfp4_block), "nvfp4": (16, nvfp4_block)}
