"""The packed GEMM (activations times 4-bit codes decoded in registers), interpreted on the
CPU, against the decode-then-GEMM it replaces: the weight values it multiplies are the
decoder's bit for bit, and where every partial sum is exact (so that no GEMM's order can
matter) its outputs are :func:`fp4rl.gemm.mm`'s bit for bit, epilogue included (term
scales, NVFP4's tensor scale, ResQ's two terms, the bias, one rounding to bf16)."""

from __future__ import annotations

import pytest
import torch

from fp4rl.formats import get_format
from fp4rl.gemm import Operand, PackedOperand, fuses_packed, mm, mm_packed, pack_operand

pytest.importorskip("triton")

from fp4rl.kernels import triton_packed_mm
from fp4rl.kernels.triton_packed_mm import BK, PARTIAL_SHARE, SPLIT_PROGRAMS, k_split, packed_mm_2d

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered")
FORMATS = ["hif4", "mxfp4", "nvfp4", "nvfp4_per_token"]
BF16 = torch.bfloat16


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setenv("FP4RL_KERNELS", "triton")
    monkeypatch.delenv("FP4RL_DISABLE_KERNELS", raising=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, or NaN in both places."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(_bits(a)[~nan], _bits(b)[~nan]))


def _grid_weight(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Quarter-integers: every quantized value and every product with a small integer
    lies on a grid fine enough that the sums of a few hundred are exact in fp32."""
    return torch.randint(-12, 13, (rows, cols), generator=g).float() * 0.25


def _fields(p: PackedOperand) -> dict[str, torch.Tensor]:
    return p.row_fields()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cols", [64, 200])
def test_the_weight_it_multiplies_is_the_decoders(fmt, cols):
    """One-hot activations pick out single weight values: heavy-tailed weights (scales
    across the exponent range), a zero row, a partial last block."""
    g = torch.Generator().manual_seed(1)
    rows = 70
    w = torch.randn(rows, cols, generator=g) * torch.exp(2 * torch.randn(rows, cols, generator=g))
    w[5] = 0.0
    p = pack_operand(w, get_format(fmt))
    decoded = p.decode(torch.float32).values
    for first in range(0, cols, 64):
        eye = torch.eye(cols)[first:first + 64].to(BF16)
        y = packed_mm_2d(get_format(fmt), eye, 1, _fields(p), rows, cols, [None], None, None)
        assert torch.equal(y.float(), decoded.t()[first:first + 64])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5, 16, 17, 64, 65, 130])
@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_outputs_are_mm_bit_for_bit_where_sums_are_exact(fmt, m, terms, bias):
    g = torch.Generator().manual_seed(m * 10 + terms)
    rows, cols = 70, 200
    p = pack_operand(_grid_weight(rows, cols, g), get_format(fmt))
    a = torch.randint(-8, 9, (terms * m, cols), generator=g).to(BF16)
    scales = [torch.rand(m, 1, generator=g) + 0.5, torch.rand((), generator=g) + 0.5][:terms]
    b = torch.randn(rows, generator=g).to(BF16) if bias else None
    y = packed_mm_2d(get_format(fmt), a, terms, _fields(p), rows, cols, scales, p.scale, b)
    ops = [Operand(a[i * m:(i + 1) * m], s) for i, s in enumerate(scales)]
    want = mm(ops, p.decode(BF16).t(), BF16, b)
    assert y.dtype == BF16 and y.shape == (m, rows)
    assert _same(y, want)


def test_a_nan_block_spoils_its_outputs_as_in_the_decode():
    g = torch.Generator().manual_seed(3)
    w = _grid_weight(40, 96, g)
    w[7, 3] = float("nan")
    p = pack_operand(w, get_format("hif4"))
    a = torch.randint(-8, 9, (3, 96), generator=g).to(BF16)
    y = packed_mm_2d(get_format("hif4"), a, 1, _fields(p), 40, 96, [None], None, None)
    want = mm(Operand(a), p.decode(BF16).t(), BF16)
    assert y[:, 7].isnan().all() and _same(y, want)


@pytest.mark.parametrize("fmt", ["hif4", "nvfp4"])
def test_mm_packed_takes_the_kernel_at_every_token_count(triton_path, fmt, monkeypatch):
    """``mm_packed`` (what the packed store runs) goes through the fused operator at every
    token count of bf16 (a decode step, a large batch, a prefill's 128-row tiles), and
    decodes then multiplies in fp32; both give ``mm``'s bits on exact sums."""
    g = torch.Generator().manual_seed(4)
    p = pack_operand(_grid_weight(48, 128, g), get_format(fmt))
    launched: list[int] = []
    real = triton_packed_mm.packed_mm_2d
    monkeypatch.setattr(triton_packed_mm, "packed_mm_2d",
                        lambda *args: launched.append(args[1].shape[0]) or real(*args))
    for m, dtype, fused in ((1, BF16, True), (64, BF16, True), (65, BF16, True),
                            (200, BF16, True), (4, torch.float32, False)):
        a = Operand(torch.randint(-8, 9, (m, 128), generator=g).to(dtype))
        assert fuses_packed(a, p, dtype) == fused
        launched.clear()
        y = mm_packed(a, p, dtype)
        assert launched == ([m] if fused else [])
        assert _same(y, mm(a, p.decode(dtype).t(), dtype)) if dtype == BF16 else \
            torch.equal(y, mm(a, p.decode(dtype).t(), dtype))


def test_without_a_kernel_the_operator_decodes_then_multiplies():
    """On a CPU without the Triton path the operator is the decode and ``mm`` (what a
    compiled engine traces runs anywhere)."""
    g = torch.Generator().manual_seed(5)
    p = pack_operand(_grid_weight(24, 64, g), get_format("mxfp4"))
    a = torch.randint(-8, 9, (6, 64), generator=g).to(BF16)
    f = p.row_fields()
    names = sorted(f)
    y = torch.ops.fp4rl.packed_mm(a, [f[n] for n in names], ",".join(names), "mxfp4", 24, 64,
                                  2, None, torch.tensor(0.5), None, None)
    want = mm([Operand(a[:3]), Operand(a[3:], torch.tensor(0.5))], p.decode(BF16).t(), BF16)
    assert _same(y, want)


def test_the_operator_passes_opcheck(triton_path):
    g = torch.Generator().manual_seed(6)
    p = pack_operand(_grid_weight(32, 64, g), get_format("nvfp4"))
    f = p.row_fields()
    names = sorted(f)
    a = torch.randint(-8, 9, (4, 64), generator=g).to(BF16)
    torch.library.opcheck(torch.ops.fp4rl.packed_mm.default,
                          (a, [f[n] for n in names], ",".join(names), "nvfp4", 32, 64, 1,
                           torch.rand(4, 1, generator=g), None, p.scale,
                           torch.zeros(32, dtype=BF16)))


def test_a_store_of_several_parts_fuses_each(triton_path, monkeypatch):
    """A merged layer of two NVFP4 parts, each with its own tensor scale (as vLLM's qkv
    and gate_up carry them): the packed store multiplies each part in the fused kernel,
    and equals the dequantized store's GEMMs, bias slices included."""
    from fp4rl.kernels import triton_packed_mm
    from fp4rl.rollout.vllm.stores import DequantizedStore, PackedStore

    g = torch.Generator().manual_seed(7)
    parts = [pack_operand(_grid_weight(40, 96, g) * s, get_format("nvfp4")) for s in (1.0, 8.0)]
    assert not torch.equal(parts[0].scale, parts[1].scale)
    acts = [Operand(torch.randint(-8, 9, (5, 96), generator=g).to(BF16))]
    bias = torch.randn(80, generator=g).to(BF16)
    launched: list[int] = []
    real = triton_packed_mm.packed_mm_2d
    monkeypatch.setattr(triton_packed_mm, "packed_mm_2d",
                        lambda *args: launched.append(args[4]) or real(*args))
    packed = PackedStore.of(list(parts), BF16)
    y = packed.apply(acts, BF16, bias)
    assert launched == [40, 40]
    dense = DequantizedStore.of(list(parts), BF16, prepack=False)
    assert _same(y, dense.apply(acts, BF16, bias))


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_a_bias_of_any_type_joins_the_accumulator_as_in_mm(bias_dtype):
    """A float32 bias (an FP32 master's) is added unrounded to the scaled sum, a bf16 one
    as it is, another widened: :func:`fp4rl.gemm.mm`'s epilogue."""
    g = torch.Generator().manual_seed(8)
    p = pack_operand(_grid_weight(40, 64, g), get_format("nvfp4"))
    a = torch.randint(-8, 9, (3, 64), generator=g).to(BF16)
    bias = torch.randn(40, generator=g).to(bias_dtype)
    y = packed_mm_2d(get_format("nvfp4"), a, 1, _fields(p), 40, 64, [None], p.scale, bias)
    assert _same(y, mm(Operand(a), p.decode(BF16).t(), BF16, bias))


@pytest.mark.parametrize("recipe", ["hif4", "nvfp4", "hif4+resq-2:4"])
def test_the_fp4_layer_decodes_in_the_fused_kernel_at_every_size(triton_path, monkeypatch,
                                                                   recipe):
    """fp4rl's own engine: an FP4 layer in rollout mode multiplies a few bf16 tokens by its
    rollout Q(W) kept as packed codes, in the fused kernel (the same bits as its dense
    Q(W) where sums are exact), at a prefill's token count too, ResQ's residual handed
    over n:m sparse; in fp32 and under the batch-invariant forward it keeps its dense
    Q(W)."""
    from fp4rl.nn import FP4Linear, batch_invariant, get_recipe, rollout_mode

    g = torch.Generator().manual_seed(9)
    layer = FP4Linear.from_linear(torch.nn.Linear(128, 48), get_recipe(recipe))
    with torch.no_grad():
        layer.weight.copy_(_grid_weight(48, 128, g))
        layer.bias.copy_(torch.randn(48, generator=g))
    launched: list[int] = []
    real = triton_packed_mm.packed_mm_2d
    monkeypatch.setattr(triton_packed_mm, "packed_mm_2d",
                        lambda *args: launched.append(args[1].shape[0]) or real(*args))

    def run(x: torch.Tensor) -> torch.Tensor:
        launched.clear()
        with rollout_mode(layer):
            return layer(x)

    x = torch.randint(-8, 9, (2, 3, 128), generator=g).to(BF16)
    nm: list[bool] = []
    monkeypatch.setattr(triton_packed_mm, "packed_mm_2d",
                        lambda *args: launched.append(args[1].shape[0]) or
                        nm.append(args[-1] is not None) or real(*args))
    fused = run(x)
    assert launched, "the fused kernel did not run"
    monkeypatch.setenv("FP4RL_DISABLE_KERNELS", "1")
    dense = run(x)
    assert not launched
    monkeypatch.delenv("FP4RL_DISABLE_KERNELS")
    assert fused.shape == (2, 3, 48) and _same(fused, dense)
    assert set(nm) == {"resq" in recipe}
    run(torch.zeros(130, 128, dtype=BF16))
    assert launched == [130]
    run(x.float())
    assert not launched
    with batch_invariant():
        run(x)
    assert not launched


def test_under_vllms_batch_invariant_mode_the_store_decodes_first(triton_path, monkeypatch):
    """vLLM's batch-invariant mode replaces aten.mm; a packed store built under it keeps its
    GEMMs there (decode, then mm) instead of the fused kernel."""
    from fp4rl.kernels import triton_packed_mm
    from fp4rl.rollout.vllm import stores

    g = torch.Generator().manual_seed(10)
    part = pack_operand(_grid_weight(40, 96, g), get_format("hif4"))
    acts = [Operand(torch.randint(-8, 9, (3, 96), generator=g).to(BF16))]
    launched: list[int] = []
    real = triton_packed_mm.packed_mm_2d
    monkeypatch.setattr(triton_packed_mm, "packed_mm_2d",
                        lambda *args: launched.append(1) or real(*args))
    for invariant, fused in ((False, True), (True, False)):
        monkeypatch.setattr(stores, "_vllm_batch_invariant", lambda v=invariant: v)
        launched.clear()
        y = stores.PackedStore.of([part], BF16).apply(acts, BF16, None)
        assert bool(launched) == fused
        assert _same(y, mm(acts, part.decode(BF16).t(), BF16))


def _split_case(fmt: str, m: int, cols: int, terms: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = 70
    p = pack_operand(_grid_weight(rows, cols, g), get_format(fmt))
    a = torch.randint(-8, 9, (terms * m, cols), generator=g).to(BF16)
    scales = [torch.rand(m, 1, generator=g) + 0.5, torch.rand((), generator=g) + 0.5][:terms]
    b = torch.randn(rows, generator=g).to(BF16)
    return p, a, scales, b, rows


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("m", "cols", "k_part"), [(1, 200, 32), (3, 1000, 96),
                                                    (5, 517, 160), (17, 300, 64)])
@pytest.mark.parametrize("terms", [1, 2])
def test_a_split_of_k_gives_the_unsplit_bits(fmt, m, cols, k_part, terms, monkeypatch):
    """K cut into parts of ``k_part`` columns (the last one short, a part ending inside a
    HiF4 block of 64), each part's fp32 sums written and added in part order by the
    reduction: on exact sums, the unsplit kernel's bits and ``mm``'s, epilogue included."""
    p, a, scales, b, rows = _split_case(fmt, m, cols, terms, m * 100 + cols)
    whole = packed_mm_2d(get_format(fmt), a, terms, _fields(p), rows, cols, scales, p.scale, b)
    monkeypatch.setattr(triton_packed_mm, "k_split", lambda *args: k_part)
    launched: list[str] = []
    real = triton_packed_mm.Variant.launch
    monkeypatch.setattr(triton_packed_mm.Variant, "launch", lambda self, *args: (
        launched.append(self.kernel.__name__), real(self, *args))[1])
    split = packed_mm_2d(get_format(fmt), a, terms, _fields(p), rows, cols, scales, p.scale, b)
    assert launched == ["_packed_mm_kernel", "_packed_reduce_kernel"]
    ops = [Operand(a[i * m:(i + 1) * m], s) for i, s in enumerate(scales)]
    assert _same(split, whole) and _same(split, mm(ops, p.decode(BF16).t(), BF16, b))


def test_a_nan_block_spoils_its_outputs_through_a_split(monkeypatch):
    g = torch.Generator().manual_seed(11)
    w = _grid_weight(40, 256, g)
    w[7, 200] = float("nan")
    p = pack_operand(w, get_format("hif4"))
    a = torch.randint(-8, 9, (3, 256), generator=g).to(BF16)
    monkeypatch.setattr(triton_packed_mm, "k_split", lambda *args: 64)
    y = packed_mm_2d(get_format("hif4"), a, 1, _fields(p), 40, 256, [None], None, None)
    assert y[:, 7].isnan().all() and _same(y, mm(Operand(a), p.decode(BF16).t(), BF16))


@pytest.mark.parametrize(("m", "n", "k", "terms"), [(1, 2048, 11008, 1), (4, 2048, 11008, 2),
                                                    (1, 2048, 2048, 1), (3, 4096, 5000, 1)])
def test_a_small_launch_splits_k_to_fill_the_gpu(m, n, k, terms):
    """2048 outputs at a decode step are 32 programs: K is split into parts of whole BK
    steps so that the launch has about SPLIT_PROGRAMS programs, unless the partial sums'
    bytes would pass their share of the weight's; the same shape always splits alike."""
    part = k_split(m, n, k, terms)
    assert part % BK == 0 and BK <= part < k
    splits = -(-k // part)
    tiles = -(-m // triton_packed_mm.height(m, terms)) * -(-n // 64)
    cap = k // (4 * PARTIAL_SHARE * terms * m)  # the partials' share of the weight's bytes
    assert splits * tiles >= min(SPLIT_PROGRAMS, tiles * cap) or splits == cap
    assert (splits - 1) * tiles < SPLIT_PROGRAMS
    assert 8 * splits * terms * m * n <= 2 * n * k // PARTIAL_SHARE
    assert k_split(m, n, k, terms) == part


@pytest.mark.parametrize(("m", "n", "k", "terms"), [(64, 2048, 11008, 1), (1, 11008, 2048, 1),
                                                    (16, 2048, 2048, 2), (1, 64, 64, 1),
                                                    (0, 2048, 2048, 1)])
def test_no_split_where_the_gpu_is_full_or_partials_would_cost(m, n, k, terms):
    assert k_split(m, n, k, terms) == k
