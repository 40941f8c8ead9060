"""Every build of the C kernels computes the same bits, whatever vector ISA it is compiled
for (SSE2 alone, AVX2 + FMA, AVX-512), so a machine with AVX-512, one with AVX2 only and
one with SSE alone score a token alike:

- the batch-invariant GEMM: every output is one sequence of float32 fused multiply-adds
  and adds, which the tile and the vector width only schedule (an SSE2 build without the
  FMA instruction takes C's correctly rounded ``fmaf``);
- HiF4's quantizer: the AVX-512 build rounds in float32 with fused multiply-adds
  (``hif4_v_round`` in quant.c), the others in float64; both give the reference's values
  (tests/kernels/test_cpu_values.py holds the edge cases).
"""

from __future__ import annotations

import ctypes
import platform
import shutil
from pathlib import Path

import pytest
import torch

from fp4rl.kernels import cpu

COMPILER = shutil.which("cc") or shutil.which("gcc")
def _marches() -> list[str]:
    """SSE2 alone (C's fmaf), AVX2 + FMA (the 6 x 16 tile) and, where the CPU runs it,
    AVX-512 without the tile unit (the 8 x 32 tile)."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return ["x86-64", "x86-64-v3", *(["x86-64-v4"] if " avx512f" in flags else [])]


pytestmark = pytest.mark.skipif(
    COMPILER is None or platform.machine() not in ("x86_64", "AMD64") or
    cpu.load_library() is None, reason="needs an x86-64 CPU and a C compiler")


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    """The library built for each ISA this CPU runs (once for the module)."""
    directory = tmp_path_factory.mktemp("isa")
    return {march: cpu.build_for(march, directory) for march in _marches()}


def _gemm(lib: ctypes.CDLL, a: torch.Tensor, w: torch.Tensor, chunk: int) -> torch.Tensor:
    """The float32 accumulators (unrounded: a bf16 output would hide a last-bit change)."""
    b = w.t()
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32)
    bf16 = int(a.dtype == torch.bfloat16)
    assert lib.fp4rl_bi_gemm(1, a.shape[0], b.shape[1], a.shape[1],
                             a.data_ptr(), bf16, 0, a.stride(0), a.stride(1),
                             b.data_ptr(), bf16, 0, b.stride(0), b.stride(1),
                             None, out.data_ptr(), 0, 0, out.stride(0), chunk, 2, None) == 0
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_gives_the_same_bits(builds, dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(13, 200, generator=g).to(dtype)
    w = torch.randn(75, 200, generator=g).to(dtype)
    lib = cpu.load_library()
    for chunk in (0, cpu.BI_CHUNK):
        outs = {march: _gemm(built, a, w, chunk) for march, built in builds.items()}
        first = outs["x86-64"]
        for march, out in outs.items():
            assert torch.equal(out, first), march
        native = cpu.bi_gemm(a, w.t(), chunk=chunk, out_dtype=torch.float32)
        bf16 = int(dtype == torch.bfloat16)
        if lib.fp4rl_bi_layout(bf16, bf16, chunk) == 0:  # the FMA tile: the same bits
            assert torch.equal(native, first)
        else:  # bf16 on the tile unit (AMX): its own sums, tests/kernels/test_invariant_amx.py
            assert torch.allclose(native, first, rtol=1e-5, atol=1e-5)


def _values(lib: ctypes.CDLL, x: torch.Tensor, out_dtype: torch.dtype) -> list[torch.Tensor]:
    """HiF4's block values of ``x`` along its rows and its columns in ``out_dtype``, and
    ResQ-2:4's two bf16 terms of its rows, as bits."""
    rows, cols = (torch.empty(x.shape, dtype=out_dtype) for _ in range(2))
    bf16_in, bf16_out = int(x.dtype == torch.bfloat16), int(out_dtype == torch.bfloat16)
    assert lib.fp4rl_quantize_values(0, x.data_ptr(), bf16_in, *x.shape, rows.data_ptr(),
                                     cols.data_ptr(), bf16_out, 0.0, 2) == 0
    q, r = (torch.empty(x.shape, dtype=torch.bfloat16) for _ in range(2))
    xb = x.bfloat16()
    assert lib.fp4rl_resq_terms_bf16(0, xb.data_ptr(), q.data_ptr(), r.data_ptr(), *x.shape,
                                     2, 4, 2) == 0
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return [t.view(ints[t.dtype]) for t in (rows, cols, q, r)]


@pytest.mark.parametrize("types", [(torch.float32, torch.bfloat16),
                                   (torch.bfloat16, torch.bfloat16),
                                   (torch.float32, torch.float32)])
def test_hif4_values_are_the_same_in_every_build(builds, types):
    """Whole blocks, 64 x 16 stripes and the partial ones around them (130 x 200), values
    over 60 octaves, a NaN and an Inf: every build, and this process's own library, write
    the same bits."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(130, 200, generator=g) * torch.exp2(torch.randint(-30, 30, (130, 200),
                                                                       generator=g).float())
    x[3, 70], x[100, 5] = float("nan"), float("inf")
    x = x.to(types[0])
    outs = {march: _values(lib, x, types[1]) for march, lib in builds.items()}
    outs["native"] = _values(cpu.load_library(), x, types[1])
    for march, out in outs.items():
        for name, got, want in zip(("rows", "cols", "Q(x)", "residual"), out,
                                   outs["x86-64"], strict=True):
            assert torch.equal(got, want), (march, name)


def test_fp4rl_march_names_the_build_target(monkeypatch, tmp_path):
    """``FP4RL_MARCH`` builds this process's library for another CPU kind, cached apart
    from the native one; a target the compiler does not know is named in the error."""
    native = cpu._library_path()
    monkeypatch.setenv("FP4RL_MARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in cpu.build_flags()
    assert cpu._library_path() != native
    monkeypatch.setenv("FP4RL_MARCH", "no-such-cpu")
    with pytest.raises(RuntimeError, match="FP4RL_MARCH=no-such-cpu: unset it"):
        cpu._compile(tmp_path / "quant.so")
