"""The batch-invariant GEMM of bf16 operands on a CPU with AMX: the tile unit sums each
run of 64 products in an order of its own (not IEEE's sequence of fused multiply-adds, and
flushing denormals), so its bits are checked here as the property the forward needs, an
output that depends on its own row and column alone, and its values against float64."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fp4rl.kernels import cpu

LIB = cpu.load_library()
pytestmark = pytest.mark.skipif(LIB is None or LIB.fp4rl_bi_layout(1, 1, cpu.BI_CHUNK) != 1,
                                reason="needs a CPU with AMX (amx_bf16) that grants the tiles")


def _operands(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).bfloat16(),
            torch.randn(n, k, generator=g).bfloat16())


@pytest.mark.parametrize("chunk", [cpu.BI_CHUNK, cpu.BI_NO_RUNS])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 32), (37, 200, 75), (70, 576, 130)])
def test_a_rows_result_is_its_own_on_the_tile_unit(m, k, n, chunk):
    """In runs of 64 (the batch-invariant forward's) and in one run of all K (the default
    forward's ``mm_fp32``, the tiles accumulating every step)."""
    a, w = _operands(m, k, n, m)
    together = cpu.bi_gemm(a, w.t(), out_dtype=torch.float32, chunk=chunk)
    alone = torch.cat([cpu.bi_gemm(a[i:i + 1], w.t(), out_dtype=torch.float32, chunk=chunk)
                       for i in range(m)])
    assert torch.equal(alone, together)
    assert torch.equal(cpu.bi_gemm(torch.cat([a, a, a[:5]]), w.t(), out_dtype=torch.float32,
                                   chunk=chunk)[m:2 * m], together)
    # a column's result is its own too: a slice of the weight's rows
    assert torch.equal(cpu.bi_gemm(a, w[3:].t(), out_dtype=torch.float32, chunk=chunk),
                       together[:, 3:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu.bi_gemm(a, w.t(), out_dtype=torch.float32, chunk=chunk),
                           together)
    finally:
        torch.set_num_threads(threads)
    exact = a.double() @ w.t().double()
    scale = a.double().abs() @ w.t().double().abs()
    assert ((together.double() - exact).abs() <= 1e-6 * scale + 1e-30).all()


def test_the_output_is_the_accumulator_rounded_once_with_the_bias_added_last():
    a, w = _operands(45, 300, 90, 1)
    bias = torch.randn(90, generator=torch.Generator().manual_seed(2)).bfloat16()
    acc = cpu.bi_gemm(a, w.t(), out_dtype=torch.float32)
    assert torch.equal(cpu.bi_gemm(a, w.t(), bias), (acc + bias.float()).bfloat16())


def test_kept_panels_take_the_tile_units_layout():
    a, w = _operands(40, 576, 300, 3)
    fresh = cpu.bi_gemm(a, w.t(), out_dtype=torch.float32)
    with cpu.keep_panels():
        assert torch.equal(cpu.bi_gemm(a, w.t(), out_dtype=torch.float32), fresh)
        assert torch.equal(cpu.bi_gemm(a[:7], w.t(), out_dtype=torch.float32), fresh[:7])
        # the same weight read as float32 takes the FMA tile: another layout, kept apart
        wide = cpu.bi_gemm(a.float(), w.t().float(), out_dtype=torch.float32)
        assert torch.equal(cpu.bi_gemm(a.float(), w.t().float()), wide)


def test_runs_that_the_tile_unit_cannot_take_go_to_the_fma_tile():
    assert LIB.fp4rl_bi_layout(1, 1, 0) == 0  # attention's one sequential sum
    assert LIB.fp4rl_bi_layout(1, 1, 48) == 0  # not a multiple of 32 products
    assert LIB.fp4rl_bi_layout(0, 1, 64) == 0  # a float32 operand
    assert LIB.fp4rl_bi_layout(1, 1, cpu.BI_NO_RUNS) == 1  # no runs: the tiles take all K


def test_fp4rl_amx_0_keeps_bf16_on_the_fma_tile():
    """With the tile unit turned off a bf16 GEMM is the FMA path's: the float32 GEMM of the
    widened operands (bf16 products are exact in float32), as on a CPU without AMX, and
    no runs there are chunk 0's one sequential sum."""
    code = ("import torch\nfrom fp4rl.kernels import cpu\n"
            "g = torch.Generator().manual_seed(4)\n"
            "a = torch.randn(37, 300, generator=g).bfloat16()\n"
            "w = torch.randn(70, 300, generator=g).bfloat16()\n"
            "assert cpu.load_library().fp4rl_bi_layout(1, 1, 64) == 0\n"
            "out = cpu.bi_gemm(a, w.t(), out_dtype=torch.float32)\n"
            "assert torch.equal(out, cpu.bi_gemm(a.float(), w.t().float()))\n"
            "one = cpu.bi_gemm(a, w.t(), out_dtype=torch.float32, chunk=cpu.BI_NO_RUNS)\n"
            "assert torch.equal(one, cpu.bi_gemm(a, w.t(), out_dtype=torch.float32, chunk=0))\n")
    env = {**os.environ, "FP4RL_AMX": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]



@pytest.mark.parametrize("chunk", [cpu.BI_CHUNK, cpu.BI_NO_RUNS])
def test_rows_of_any_stride_and_a_partial_tile_give_the_same_bits(chunk):
    """The A block is copied 32 k's at a time where a row's k's are contiguous and value by
    value otherwise; a K and an N short of a tile are masked. Both layouts, one result,
    in float32 and rounded to bf16 as ``Tensor.bfloat16`` rounds."""
    a, w = _operands(50, 203, 45, 3)
    strided = a.t().contiguous().t()  # the same values, k's apart by the row count
    assert strided.stride(1) != 1
    want = cpu.bi_gemm(a, w.t(), out_dtype=torch.float32, chunk=chunk)
    assert torch.equal(cpu.bi_gemm(strided, w.t(), out_dtype=torch.float32, chunk=chunk), want)
    assert torch.equal(cpu.bi_gemm(strided, w.t(), chunk=chunk), want.bfloat16())
    exact = a.double() @ w.t().double()
    assert ((want.double() - exact).abs() <= 1e-6 * (a.double().abs() @
                                                    w.t().double().abs()) + 1e-30).all()
