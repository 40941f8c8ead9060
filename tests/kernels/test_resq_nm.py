"""ResQ's residual kept as n:m sparse hardware keeps it (kept values in order and a bit
per kept position), interpreted on the CPU: expanded, it is the dense term the ResQ
kernel writes bit for bit (signed zeros, NaN blocks, a partial last group and block), and
the packed GEMM that expands it in registers gives the bits of the same GEMM on the
dense term."""

from __future__ import annotations

import pytest
import torch

from fp4rl.formats import get_format
from fp4rl.gemm import NMOperand, pack_operand

pytest.importorskip("triton")

from fp4rl.kernels import triton_quant
from fp4rl.kernels.triton_packed_mm import packed_mm_2d

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered")
BF16 = torch.bfloat16


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, or NaN in both places."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and
                torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan]))


def _rows(n: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cols, generator=g) * torch.exp(torch.randn(n, cols, generator=g))
    if n > 2:
        x[1, 5:9] = 0.0
        x[2, :] = -0.0
    if n > 4:
        x[4, 3] = float("nan")
    return x.to(dtype)


def _nm(fmt: str, x: torch.Tensor, keep: int, group: int) -> tuple[torch.Tensor, NMOperand]:
    out = triton_quant.resq_terms_nm(get_format(fmt), x, keep, group)
    assert out is not None
    q, kept, bits = out
    return q, NMOperand(kept, bits, keep, group, x.shape[1])


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
@pytest.mark.parametrize(("keep", "group"), [(2, 4), (1, 4), (4, 8), (1, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("cols", [64, 70, 200])
def test_expanded_it_is_the_dense_term(fmt, keep, group, dtype, cols):
    x = _rows(6, cols, dtype, keep * 100 + group * 10 + cols)
    dense = triton_quant.resq_terms(get_format(fmt), x, keep, group)
    assert dense is not None
    q, r = _nm(fmt, x, keep, group)
    groups = -(-cols // group)
    assert r.values.shape == (6, groups * keep) and r.bits.shape == (6, groups)
    assert r.values.dtype == BF16 and r.bits.dtype == torch.uint8
    # every group keeps exactly `keep` positions
    ones = sum((r.bits.int() >> j) & 1 for j in range(group))
    assert bool((ones == keep).all())
    assert _same(q, dense[:6])
    # the same term, except in a block holding NaN (Q(x) is NaN there too: every output
    # of its row is NaN either way), where each group keeps its first `keep` NaNs
    spoilt = q.isnan()
    expanded = r.dense()
    assert _same(expanded[~spoilt], dense[6:][~spoilt])
    assert bool(expanded[spoilt].isnan().any()) == bool(spoilt.any())
    assert r.nbytes < dense[6:].numel() * 2


def test_none_for_a_dense_residual_or_a_scaled_format():
    x = _rows(3, 64, torch.float32, 1)
    assert triton_quant.resq_terms_nm(get_format("hif4"), x, 0, 0) is None
    assert triton_quant.resq_terms_nm(get_format("nvfp4"), x, 2, 4) is None


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
@pytest.mark.parametrize("m", [1, 17, 40])
@pytest.mark.parametrize(("keep", "group"), [(2, 4), (4, 8)])
def test_the_packed_gemm_expands_it_in_registers(fmt, m, keep, group):
    """The same GEMM on the dense residual and on the n:m one: the same tile values in
    the same order, so the same bits (any data, not only exact sums)."""
    g = torch.Generator().manual_seed(m + group)
    rows, cols = 70, 200
    w = torch.randn(rows, cols, generator=g)
    p = pack_operand(w, get_format(fmt))
    x = _rows(m, cols, BF16, m)
    dense = triton_quant.resq_terms(get_format(fmt), x, keep, group)
    assert dense is not None
    q, r = _nm(fmt, x, keep, group)
    bias = torch.randn(rows, generator=g).to(BF16)
    want = packed_mm_2d(get_format(fmt), dense, 2, p.row_fields(), rows, cols, [None, None],
                        p.scale, bias)
    got = packed_mm_2d(get_format(fmt), q, 2, p.row_fields(), rows, cols, [None, None],
                       p.scale, bias, residual=(r.values, r.bits, r.keep, r.group))
    assert _same(got, want)


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setenv("FP4RL_KERNELS", "triton")
    monkeypatch.delenv("FP4RL_DISABLE_KERNELS", raising=False)


def _resq(recipe: str = "hif4+resq-2:4", k: int = 96):
    from fp4rl.nn import get_recipe
    from fp4rl.recovery import make_recovery

    r = get_recipe(recipe).rollout
    return make_recovery(r.recovery, r.activations, k, 0, weight_format=r.weights)


def test_the_operators_pass_opcheck(triton_path):
    import fp4rl.kernels.triton_ops  # noqa: F401  (registers fp4rl::resq_terms_nm)
    from fp4rl.recovery.ops import TracedActivation

    x = _rows(5, 96, BF16, 2)
    x[4, 3] = 1.0  # opcheck compares outputs: no NaN
    torch.library.opcheck(torch.ops.fp4rl.resq_terms_nm.default,
                          (x, *_format_args("hif4"), 2, 4))
    traced = TracedActivation(_resq())
    torch.library.opcheck(torch.ops.fp4rl.rollout_activation_nm.default, (x, traced.handle))
    p = pack_operand(torch.randn(32, 96), get_format("hif4"))
    q, r = _nm("hif4", x, 2, 4)
    f = p.row_fields()
    names = sorted(f)
    torch.library.opcheck(torch.ops.fp4rl.packed_mm.default,
                          (q, [f[n] for n in names], ",".join(names), "hif4", 32, 96, 2, None,
                           None, None, None, r.values, r.bits, 2, 4))


def _format_args(fmt: str) -> tuple[int, int, bool]:
    code, block = triton_quant.format_fields(get_format(fmt))
    return code, block, False


def test_a_packed_store_takes_the_residual_n_m_sparse(triton_path, monkeypatch):
    """vLLM's method on a packed store that fuses: the traced activation hands ResQ's
    residual over n:m sparse, and the product has the bits of the dense terms' (the same
    tile values in the same order); a store that does not fuse gets dense terms."""
    from fp4rl.gemm import Operand
    from fp4rl.recovery.ops import TracedActivation
    from fp4rl.rollout.vllm.stores import DequantizedStore, PackedStore

    recovery = _resq()
    traced = TracedActivation(recovery)
    g = torch.Generator().manual_seed(3)
    part = pack_operand(torch.randn(40, 96, generator=g), get_format("hif4"))
    store = PackedStore.of([part], BF16)
    assert store.takes_nm() and recovery.packed_nm(torch.device("cpu")) == (2, 4)
    x = _rows(7, 96, BF16, 4)
    sparse = traced(x, BF16, packed=True)
    dense = traced(x, BF16)
    assert isinstance(sparse[1], NMOperand) and all(isinstance(t, Operand) for t in dense)
    bias = torch.randn(40, generator=g).to(BF16)
    assert _same(store.apply(sparse, BF16, bias), store.apply(dense, BF16, bias))
    plain = DequantizedStore.of([part], BF16, prepack=False)
    assert not plain.takes_nm()
    assert _same(plain.apply(sparse, BF16, bias), plain.apply(dense, BF16, bias))
    monkeypatch.setenv("FP4RL_DISABLE_KERNELS", "1")  # no kernel: the dense terms
    assert recovery.packed_nm(torch.device("cpu")) is None
    assert all(isinstance(t, Operand) for t in recovery.packed_activation(x, BF16))


@pytest.mark.parametrize(("m", "k_part"), [(1, 32), (5, 96)])
def test_a_split_of_k_takes_the_n_m_term_too(m, k_part, monkeypatch):
    """K cut into parts (one ending inside a group's block): the n:m term's parts are
    read where its dense twin's are, and the split gives the dense twin's split bits."""
    from fp4rl.kernels import triton_packed_mm

    g = torch.Generator().manual_seed(m)
    rows, cols = 70, 300
    p = pack_operand(torch.randn(rows, cols, generator=g), get_format("hif4"))
    x = _rows(m, cols, BF16, 40 + m)
    dense = triton_quant.resq_terms(get_format("hif4"), x, 2, 4)
    assert dense is not None
    q, r = _nm("hif4", x, 2, 4)
    monkeypatch.setattr(triton_packed_mm, "k_split", lambda *args: k_part)
    want = packed_mm_2d(get_format("hif4"), dense, 2, p.row_fields(), rows, cols, [None, None],
                        p.scale, None)
    got = packed_mm_2d(get_format("hif4"), q, 2, p.row_fields(), rows, cols, [None, None],
                       p.scale, None, residual=(r.values, r.bits, r.keep, r.group))
    assert _same(got, want)
