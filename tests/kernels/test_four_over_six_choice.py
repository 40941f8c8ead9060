"""Four Over Six's choice between the scale to 4 and the scale to 6, decided exactly on
every path: blocks built so that the two squared errors tie exactly or miss a tie by one
float32 ulp of one value (nearest and stochastic rounding, with values far below the
block's grid that a draw near 1 rounds up, whose squares a float64 sum rounds). The
expected choice comes from the errors summed as rationals (``fractions.Fraction``); the
reference, the C kernel and the Triton kernel (interpreted, float32 and int32) each make
it."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from fp4rl.formats import get_format
from fp4rl.formats.nvfp4 import _scaled_to
from fp4rl.kernels import cpu
from fp4rl.kernels.codes import FormatCode

FMT = get_format("nvfp4_4o6")


def _candidates(block: torch.Tensor, u: torch.Tensor | None) -> tuple[list[float], list[float]]:
    """Each value's magnitude quantized under the scale to 4 and under the scale to 6."""
    a = block.double().abs()[None]
    noise = None if u is None else u.double()[None]
    (s4, q4), (s6, q6) = _scaled_to(a, 4.0, noise), _scaled_to(a, 6.0, noise)
    return (q4 * s4)[0].tolist(), (q6 * s6)[0].tolist()


def _difference(block: list[float], p4: list[float], p6: list[float]) -> Fraction:
    """err4 - err6, exactly."""
    return sum(((Fraction(x) - Fraction(abs(v))) ** 2 - (Fraction(y) - Fraction(abs(v))) ** 2
                for v, x, y in zip(block, p4, p6, strict=True)), Fraction(0))


def _expected(block: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    p4, p6 = _candidates(block, u)
    four = _difference(block.tolist(), p4, p6) < 0
    return torch.tensor([abs(p) for p in (p4 if four else p6)]).copysign(block).float()


def _tie_at(block: torch.Tensor, u: torch.Tensor | None, j: int) -> list[torch.Tensor]:
    """``block`` with value j moved to where the difference of the errors (linear in it
    while its two quantizations stay) is 0, and to the float32 values either side: those
    of the three whose quantizations stay."""
    p4, p6 = _candidates(block, u)
    d = Fraction(p4[j]) - Fraction(p6[j])
    if d == 0:
        return []
    vals = block.tolist()
    def without(v: list[float]) -> list[float]:
        return [*v[:j], 0.0, *v[j + 1:]]

    rest = _difference(without(vals), without(p4), without(p6))
    target = (rest + Fraction(p4[j]) ** 2 - Fraction(p6[j]) ** 2) / (2 * d)
    if not 0 < target < Fraction(vals[0]):
        return []
    at = torch.tensor(float(target), dtype=torch.float32).view(torch.int32)
    out = []
    for bits in (-1, 0, 1):
        moved = block.clone()
        moved[j] = (at + bits).view(torch.float32)
        if _candidates(moved, u) == (p4, p6):
            out.append(moved)
    return out


def _near_ties(stochastic: bool, count: int, seed: int
               ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Blocks whose errors tie or miss by one ulp of one value (:func:`_tie_at`), their
    draws, and the exact ties among them. Stochastic: a value of 2^-16 to 2^-24 of the
    largest, which its draw (1 - 2^-24) rounds up, takes up what a tie at a larger value
    misses by, so that the blocks miss a tie by an ulp of it (2^-48 of the largest)."""
    g = torch.Generator().manual_seed(seed)
    rows, draws, ties = [], [], 0
    while len(rows) < count:
        k = torch.randint(1, 64, (16,), generator=g).float() / 8  # few bits: exact ties
        block = k * torch.exp2(torch.randint(-2, 3, (16,), generator=g).float())
        block[0] = block.abs().max() * 2  # the largest, never moved
        j = int(torch.randint(4, 16, (1,), generator=g))
        u = None
        if stochastic:
            u = torch.rand(16, generator=g)
            u[1:4] = 1 - 2.0**-24
            block[1:4] = block[0] * (1 + torch.rand(3, generator=g)) * \
                2.0**-torch.randint(16, 25, (3,), generator=g).float()
            first = _tie_at(block, u, j)
            if not first:
                continue
            block, j = first[len(first) // 2], int(torch.randint(1, 4, (1,), generator=g))
        for moved in _tie_at(block, u, j):
            ties += _difference(moved.tolist(), *_candidates(moved, u)) == 0
            rows.append(moved)
            draws.append(u if u is not None else torch.zeros(16))
    return torch.stack(rows), torch.stack(draws) if stochastic else None, ties


@pytest.mark.parametrize("stochastic", [False, True])
def test_exact_ties_and_their_neighbours_on_every_path(stochastic):
    x, u, ties = _near_ties(stochastic, 48, seed=int(stochastic))
    assert ties > 0 or stochastic  # exact ties (the scale to 6 kept); with values of 24
    # bits a tie is a rational no float32 holds, and the blocks miss it by an ulp
    expected = torch.stack([_expected(b, None if u is None else u[i])
                            for i, b in enumerate(x)])
    four = torch.tensor([_difference(b.tolist(), *_candidates(b, None if u is None else u[i])) < 0
                         for i, b in enumerate(x)])
    assert four.any() and not four.all()  # both sides of each tie
    assert torch.equal(FMT._reference_rows(x, u), expected)
    c = cpu.quantize_rows_cpu(int(FormatCode.NVFP4_4O6), x.contiguous(), u, None)
    if c is not None:  # the C library builds wherever a C compiler is
        assert torch.equal(c, expected)
    pytest.importorskip("triton")
    from fp4rl.kernels import triton_quant  # interpreted: tests/conftest.py

    tri = triton_quant.quantize_2d(FMT, x, 1, u)
    assert torch.equal(tri.view(torch.int32), expected.view(torch.int32))
