"""The C kernel's block values of a matrix along its rows, its columns or both in one call,
written straight into the GEMM's dtype (``fp4rl_quantize_values``): bit for bit the
reference quantizer's operands (NaN in the same places), at partial tiles, transposed
views, bf16 inputs and NVFP4's per-tensor scale, and the FP4 training layer that uses it
computes the same forward and gradients as with the reference quantizers."""

from __future__ import annotations

import math

import pytest
import torch

from fp4rl.formats import get_format
from fp4rl.gemm import quantize_operand, quantize_operand_pair
from fp4rl.kernels import cpu, cpu_ops

pytestmark = [
    pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered"),
    pytest.mark.skipif(cpu.load_library() is None, reason="no C compiler"),
]
FORMATS = ["hif4", "mxfp4", "nvfp4", "mxfp8_e4m3"]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values (float32 bits; NaN in the same places)."""
    a, b = a.float(), b.float()
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and
                torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)))


def _no_c_kernels(m: pytest.MonkeyPatch) -> None:
    """Every C kernel off for the dispatch (the library, once loaded, stays loaded): each
    quantizer takes the float64 reference path."""
    m.setattr(cpu_ops, "available", lambda: False)


def _reference(x: torch.Tensor, fmt: str, out_dtype: torch.dtype | None, monkeypatch):
    with monkeypatch.context() as m:
        _no_c_kernels(m)
        return (quantize_operand(x, get_format(fmt), -1, out_dtype=out_dtype),
                quantize_operand(x, get_format(fmt), 0, out_dtype=out_dtype))


def _matrix(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(3 * torch.randn(shape, generator=g))
    x[0, min(2, shape[1] - 1)] = float("nan")
    x[-1, -1] = float("-inf")
    x[-1, 0] = -0.0
    return x.to(dtype)


@pytest.fixture
def counted(monkeypatch) -> list[tuple[bool, bool]]:
    """The (rows, cols) of each call of the C values kernel."""
    calls: list[tuple[bool, bool]] = []
    real = cpu.quantize_values_cpu

    def spy(code, x, rows, cols, scale, out_dtype):
        calls.append((rows, cols))
        return real(code, x, rows, cols, scale, out_dtype)
    monkeypatch.setattr(cpu, "quantize_values_cpu", spy)
    return calls


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(37, 100), (64, 64), (130, 70), (1, 33), (200, 129)])
@pytest.mark.parametrize("types", [(torch.float32, None), (torch.float32, torch.bfloat16),
                                   (torch.bfloat16, None)])
def test_both_axes_from_one_read_are_each_axis_bit_for_bit(monkeypatch, counted, fmt, shape,
                                                           types):
    dtype, out = types
    x = _matrix(shape, dtype, shape[0])
    rows, cols = quantize_operand_pair(x, get_format(fmt), out)
    assert counted == [(True, True)]  # one call for both
    want_rows, want_cols = _reference(x, fmt, out, monkeypatch)
    assert rows.values.dtype == cols.values.dtype == (out or dtype)
    assert _same(rows.values, want_rows.values) and _same(cols.values, want_cols.values)
    for got, want in ((rows, want_rows), (cols, want_cols)):
        assert (got.scale is None) == (want.scale is None)
        assert got.scale is None or torch.equal(got.scale, want.scale)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
def test_one_axis_in_the_gemm_dtype_is_the_reference_cast(monkeypatch, counted, fmt, out,
                                                          transposed):
    """One axis, written straight into the GEMM's dtype (a weight's operand where nothing
    is kept), also of a transposed view (read without a copy): the reference quantizer's
    values cast to that dtype."""
    x = _matrix((96, 160), torch.float32, 7)
    if transposed:
        x = x.t().contiguous().t()
    want = _reference(x, fmt, out, monkeypatch)
    for axis, expected in ((-1, want[0]), (0, want[1])):
        got = quantize_operand(x, get_format(fmt), axis, out_dtype=out)
        assert got.values.dtype == out and got.values.shape == x.shape
        assert _same(got.values, expected.values)
    # a transposed view is read as the contiguous matrix it is, along the other axis
    assert counted == [(not transposed, transposed), (transposed, not transposed)]


def test_a_scale_per_token_is_left_to_the_single_axis_path(monkeypatch, counted):
    """Per-token NVFP4 has a scale per vector, which the kernel does not divide by: the
    operands come from the other passes (and still equal the reference)."""
    x = _matrix((24, 64), torch.float32, 2)
    rows, cols = quantize_operand_pair(x, get_format("nvfp4_per_token"), torch.bfloat16)
    assert counted == []
    want_rows, want_cols = _reference(x, "nvfp4_per_token", torch.bfloat16, monkeypatch)
    assert _same(rows.dense(), want_rows.dense()) and _same(cols.dense(), want_cols.dense())


@pytest.mark.parametrize("axes", [(True, True), (True, False), (False, True)])
def test_the_operator_passes_opcheck(axes):
    x = torch.randn(70, 130, generator=torch.Generator().manual_seed(4)).bfloat16()
    scale = torch.tensor(0.25)
    torch.library.opcheck(torch.ops.fp4rl.c_quantize_values,
                          (x, 0, *axes, None, torch.bfloat16))
    torch.library.opcheck(torch.ops.fp4rl.c_quantize_values,
                          (x.float(), 2, *axes, scale, torch.float32))
    out = cpu_ops.quantize_values(0, x, *axes, None, torch.bfloat16)
    assert len(out) == sum(axes)


@pytest.mark.parametrize("recipe", ["hif4", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("held", [True, False])
def test_the_training_layer_computes_the_same_with_it(monkeypatch, counted, recipe, dtype,
                                                      held):
    """Forward and backward of an FP4 linear (two micro-batches; held: the weight's two
    operands made in one call in the first and kept, else made at each GEMM) against the
    same layer with the reference quantizers: the same output, input gradient and weight
    gradient, bit for bit."""
    from fp4rl.nn import FP4Linear, get_recipe

    g = torch.Generator().manual_seed(3)
    base = torch.nn.Linear(96, 80)
    xs = [torch.randn(2, 17, 96, generator=g) for _ in range(2)]
    dys = [torch.randn(2, 17, 80, generator=g) for _ in range(2)]

    def run() -> list[torch.Tensor]:
        layer = FP4Linear.from_linear(torch.nn.Linear(96, 80), get_recipe(recipe))
        layer.load_state_dict(base.state_dict())
        if held:
            layer.hold()  # one step's micro-batches, as the trainer holds the weights
        out = []
        for x, dy in zip(xs, dys, strict=True):
            x = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                y = layer(x)
            y.backward(dy.to(y.dtype))
            out += [y.detach(), x.grad]
        return [*out, layer.weight.grad]

    fast = run()
    # per micro-batch X and dY along both axes; W along both once (held) or each GEMM's
    both, one = counted.count((True, True)), len(counted) - counted.count((True, True))
    assert (both, one) == ((5, 0) if held else (4, 4))
    _no_c_kernels(monkeypatch)
    slow = run()
    assert len(counted) == (5 if held else 8)  # the reference run called no C kernel
    assert all(_same(a, b) for a, b in zip(fast, slow, strict=True))


def _round_bits(v: float, bits: int) -> float:
    """v > 0 rounded to `bits` significant bits, ties to even (Python's round)."""
    m, e = math.frexp(v)
    return math.ldexp(round(m * 2**bits), e - bits)


def _hif4_hard_blocks(blocks: int, seed: int) -> torch.Tensor:
    """HiF4 blocks built on the edges of its float32 fast path (``hif4_v_round`` in
    quant.c). Each block's largest magnitude sets s (any of E6M2's four mantissas) and
    r = bf16(1/s) as formats.md says; the other 63 values are drawn from the float32
    values nearest the level thresholds 2/r and 4/r and the rounding ties
    (j + 1/2) 2^d / (4 r), and their float32 neighbours, with random signs. Rounding
    |x| r or |x| fin once more than the rules say flips a level bit or a tie there."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(blocks):
        k = int(torch.randint(-44, 14, (1,), generator=g))
        mant = 1 + int(torch.randint(4, (1,), generator=g)) / 4
        amax = float(torch.tensor(7 * mant * 2.0**k, dtype=torch.float32))
        s = _round_bits(max(_round_bits(amax * 0.142578125, 8), 2.0**-48), 3)
        r = _round_bits(1 / s, 8)
        points = [t / r for t in (2, 4)] + [(j + 0.5) * 2.0**d / (4 * r)
                                            for j in range(8) for d in range(3)]
        pool = torch.tensor(points, dtype=torch.float32)
        pool = torch.cat([pool, torch.nextafter(pool, torch.tensor(0.0)),
                          torch.nextafter(pool, torch.tensor(float("inf")))])
        pool = pool[pool <= amax]
        vals = pool[torch.randint(len(pool), (64,), generator=g)]
        vals[int(torch.randint(64, (1,), generator=g))] = amax
        signs = torch.randint(0, 2, (64,), generator=g).float() * 2 - 1
        rows.append(vals * signs)
    return torch.stack(rows)


@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hif4_thresholds_and_ties_are_exact(monkeypatch, out, dtype):
    """At HiF4's level thresholds and rounding ties, and one float32 step either side,
    along rows and along columns (whole blocks and 64 x 16 stripes, with edges), in both
    dtypes: the reference quantizer's values."""
    blocks = _hif4_hard_blocks(16 * 21, seed=5)
    x = blocks.reshape(-1, 64 * 3)[:, : 64 * 3 - 5].to(dtype)  # rows: 3 blocks, a partial
    want = _reference(x, "hif4", out, monkeypatch)[0]
    assert _same(quantize_operand(x, get_format("hif4"), -1, out_dtype=out).values,
                 want.values)
    xt = x.t().contiguous()  # blocks along its columns: 187 columns, 112 rows
    want_t = _reference(xt, "hif4", out, monkeypatch)[1]
    assert _same(quantize_operand(xt, get_format("hif4"), 0, out_dtype=out).values,
                 want_t.values)
