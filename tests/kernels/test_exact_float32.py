"""The Triton quantizers compute in float32 and int32 only; these inputs aim at the places
where float32 arithmetic could round where the float64 reference does not: exact ties
of every rounding (element grids, E4M3 and HiF4 scales), values one ulp either side of
them, products of 31 bits whose float32 rounding lands on a tie, subnormal blocks and
scales, the top of the float32 range, and stochastic draws that make ``t + u`` an exact
integer or miss one by an ulp. Interpreted, bit for bit against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp4rl.formats import get_format
from fp4rl.kernels import triton_quant

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered")

FORMATS = ["hif4", "mxfp4", "mxfp8_e4m3", "nvfp4", "nvfp4_4o6", "nvfp4_2d"]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


def _dyadic(rows: int, cols: int, seed: int, exponent: int = 0) -> torch.Tensor:
    """Values k/16 * 2^e (k < 128): every grid's ties and most of its thresholds are
    among them, and neighbours one ulp away from them."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, 128, (rows, cols), generator=g).float() / 16
    shift = torch.randint(-3, 4, (rows, 1), generator=g).float()
    sign = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
    x = sign * k * torch.exp2(shift + exponent)
    nudge = torch.randint(-1, 2, (rows, cols), generator=g)  # an ulp down, none, up
    bits = x.view(torch.int32) + torch.where(torch.rand(rows, cols, generator=g) < 0.3,
                                             nudge, 0).int()
    return torch.where(x == 0, x, bits.view(torch.float32))


def _reference(fmt, x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """The float64 reference of the block rule alone (no per-tensor scale) along rows
    (the 16 x 16 tiles' through the public function: their blocks span rows)."""
    if noise is None and fmt.has_tensor_scale:
        return fmt.quantize_reference(x, per_tensor_scale=False)
    return fmt._reference_rows(x, noise)


def _kernel(fmt, x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    return triton_quant.quantize_2d(fmt, x, 1, noise)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("exponent", [0, -20, -120, -135, 100, 124])
def test_ties_and_their_neighbours(name, exponent):
    fmt = get_format(name)
    x = _dyadic(32, 2 * fmt.block_size, seed=exponent + 200, exponent=exponent)
    assert _bits_equal(_kernel(fmt, x), _reference(fmt, x))


def _noise_on_the_edges(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Draws that are multiples of 2^-4 (so that t + u lands on integers for dyadic t),
    those one 2^-24 step either side, and the extremes 0 and 1 - 2^-24."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, shape, generator=g).float() / 16
    u = u + torch.randint(-1, 2, shape, generator=g).float() * 2.0**-24
    u = torch.where(torch.rand(shape, generator=g) < 0.05, 1 - 2.0**-24, u)
    return u.clamp(0, 1 - 2.0**-24)


@pytest.mark.parametrize("name", [f for f in FORMATS if f != "nvfp4_2d"])
@pytest.mark.parametrize("exponent", [0, -130, 120])
def test_stochastic_sums_that_land_on_an_integer(name, exponent):
    fmt = get_format(name)
    x = _dyadic(32, 2 * fmt.block_size, seed=exponent + 7, exponent=exponent)
    u = _noise_on_the_edges(tuple(x.shape), seed=exponent + 8)
    assert _bits_equal(_kernel(fmt, x, u), _reference(fmt, x, u))


def _hif4_tie_products(count: int) -> np.ndarray:
    """float32 amax whose product with 73/512 rounds, in float32, exactly onto a tie of
    the 8-bit rounding that follows, without being one: the product's error decides."""
    rng = np.random.default_rng(0)
    found: list[np.float32] = []
    while len(found) < count:
        m = rng.integers(2**23, 2**24, 200_000).astype(np.float64) * 2.0**-23
        exact = m * 0.142578125
        p = exact.astype(np.float32)
        tie = (p.view(np.int32) & 0xFFFF) == 0x8000
        hits = m[tie & (p.astype(np.float64) != exact)]
        found.extend(np.float32(v) for v in hits[: count - len(found)])
    return np.array(found, dtype=np.float32)


def test_hif4_scale_when_the_float32_product_lands_on_a_tie():
    fmt = get_format("hif4")
    amax = torch.from_numpy(_hif4_tie_products(16))
    x = _dyadic(16, 64, seed=3) * 0.01
    x[:, 5] = amax  # each row's largest
    assert _bits_equal(_kernel(fmt, x), _reference(fmt, x))
    u = _noise_on_the_edges((16, 64), seed=4)
    assert _bits_equal(_kernel(fmt, x, u), _reference(fmt, x, u))


@pytest.mark.parametrize("name", ["hif4", "nvfp4", "mxfp4"])
def test_levels_and_scales_one_ulp_from_their_thresholds(name):
    """Group maxima at r * v = 2 or 4 (HiF4's levels) and amax / 6 at every E4M3
    midpoint (NVFP4's scale), exactly and one ulp either side."""
    fmt = get_format(name)
    bs = fmt.block_size
    rows = []
    for mid in [m / 16 * 2.0**e for e in range(-8, 9) for m in range(17, 32, 2)]:
        base = torch.full((bs,), mid * 0.1)
        for amax in (mid * 6, mid * 4, mid * 7.0):
            for step in (-1, 0, 1):
                row = base.clone()
                top = torch.tensor(amax, dtype=torch.float32)
                row[0] = (top.view(torch.int32) + step).view(torch.float32)
                row[1:bs // 2] = row[0] / 2  # a group one level down, at its threshold
                rows.append(row)
    x = torch.stack(rows)
    assert _bits_equal(_kernel(fmt, x), _reference(fmt, x))


def test_subnormal_and_huge_blocks():
    for name in FORMATS:
        fmt = get_format(name)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(8, 2 * fmt.block_size, generator=g)
        x[0] *= 2.0**-140  # every value subnormal
        x[1] *= 2.0**-128  # a subnormal block maximum
        x[2, 0] = 2.0**-149  # the smallest
        x[3] *= 2.0**125  # near float32's largest
        x[4, :] = 0.0
        x[5, 0] = 3.3e38
        assert _bits_equal(_kernel(fmt, x), _reference(fmt, x)), name


def _round_bits(v: np.ndarray, frac: int) -> np.ndarray:
    """float64 values rounded to ``frac`` fraction bits, ties to even (formats.md)."""
    _, e = np.frexp(v)
    unit = np.ldexp(1.0, frac + 1 - e)
    return np.round(v * unit) / unit


def _hif4_scale(amax: np.ndarray) -> np.ndarray:
    """HiF4's group scale by formats.md, in float64 (exact)."""
    s = np.clip(_round_bits(amax * 0.142578125, 7), 2.0**-48, 49152.0)
    return _round_bits(s, 2)


def test_hif4_scales_that_a_rounded_product_would_change():
    """Every float32 significand whose product with 73/512, rounded to float32 first,
    would give another scale (two of 2^23): the kernel keeps the product's error."""
    m = np.arange(2**23, 2**24, dtype=np.float64) * 2.0**-23
    exact = m * 0.142578125
    rounded = exact.astype(np.float32).astype(np.float64)
    hits = m[_hif4_scale(exact) != _hif4_scale(rounded)]
    assert len(hits) > 0
    fmt = get_format("hif4")
    x = _dyadic(4 * len(hits), 64, seed=9) * 0.01
    x[:, 0] = torch.tensor(np.concatenate([hits * 2.0**k for k in (-30, 0, 3, 40)]),
                           dtype=torch.float32)
    assert _bits_equal(_kernel(fmt, x), _reference(fmt, x))


def _nearest(v: float) -> list[float]:
    """The float32 nearest to v and its two neighbours."""
    bits = np.array([v], dtype=np.float32).view(np.int32)[0]
    return [float(np.array([bits + k], dtype=np.int32).view(np.float32)[0]) for k in (-1, 0, 1)]


def test_hif4_elements_and_levels_whose_float32_products_round_onto_a_threshold():
    """Blocks built around their own reciprocal r: group maxima at the float32 values
    nearest 4 / r and 2 / r (some of whose products with r round onto exactly 4 or 2
    from below), and elements whose products with r * 2^(2 - d) round onto k + 1/2 or
    onto a multiple of 1/16 (where a draw makes the sum an integer): the rounded product
    would decide wrongly, the exact one (p + e) does not."""
    fmt = get_format("hif4")
    rng = np.random.default_rng(1)
    rows, draws = [], []
    for amax in rng.uniform(1.0, 2.0, 48) * 2.0 ** rng.integers(-4, 5, 48):
        amax = float(np.float32(amax))
        r = _round_bits(1.0 / _hif4_scale(np.array([amax]))[0], 7)
        targets = [k + 0.5 for k in range(7)] + [j / 16 for j in range(1, 112, 5)]
        row, u = np.zeros(64), np.zeros(64)
        row[0:32:4] = amax  # 8-groups 0-3 at level d = 2: x * r
        free = [i for i in range(32) if i % 4]
        for n, i in enumerate(free):
            t = targets[n % len(targets)]
            row[i] = min(_nearest(t / r)[n % 3], amax)
            u[i] = np.ceil(t) - t
        row[32:36] = _nearest(4 / r)[rng.integers(3)]  # 8-group 4: at the 4 threshold,
        row[36:40] = _nearest(1.5 / r)[rng.integers(3)]  # its second group level 0 or 1
        low = _nearest(2 / r)[0]  # 8-groups 5-7 at level d = 0: x * 4r, below 2 / r
        row[40:64:4] = low
        for n, i in enumerate(i for i in range(40, 64) if i % 4):
            t = targets[n % 8]
            row[i] = min(_nearest(t / (4 * r))[n % 3], low)
            u[i] = np.ceil(t) - t
        rows.append(row)
        draws.append(u)
        edge = row.copy()  # and a block whose level-2 threshold sits at 2 / r
        edge[32:36] = _nearest(2 / r)[rng.integers(3)]
        rows.append(edge)
        draws.append(u)
    x = torch.tensor(np.array(rows), dtype=torch.float32)
    u = torch.tensor(np.array(draws), dtype=torch.float32).clamp(0, 1 - 2.0**-24)
    assert _bits_equal(_kernel(fmt, x), _reference(fmt, x))
    assert _bits_equal(_kernel(fmt, x, u), _reference(fmt, x, u))
