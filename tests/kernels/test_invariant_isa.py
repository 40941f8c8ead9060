"""The batch-invariant GEMM gives the same bits whatever vector ISA and register tile it
is compiled for: every output is one sequence of float32 fused multiply-adds and adds,
which the tile and the vector width only schedule (an SSE2 build without the FMA
instruction takes C's correctly rounded ``fmaf``). A machine with AVX-512, one with AVX2
only and one with SSE alone then score a token alike."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fp4rl.kernels import cpu

COMPILER = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(
    COMPILER is None or platform.machine() not in ("x86_64", "AMD64") or
    cpu.load_library() is None, reason="needs an x86-64 CPU and a C compiler")


def _build(tmp_path: Path, march: str) -> ctypes.CDLL:
    flags = [f if f != "-march=native" else f"-march={march}" for f in cpu.FLAGS
             if not f.startswith("-D")]
    out = tmp_path / f"invariant-{march}.so"
    subprocess.run([COMPILER, *flags, str(cpu.INVARIANT_SOURCE), "-o", str(out), "-lm"],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    lib.fp4rl_bi_gemm.restype = ctypes.c_int
    lib.fp4rl_bi_gemm.argtypes = cpu.load_library().fp4rl_bi_gemm.argtypes
    return lib


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


def _marches() -> list[str]:
    """SSE2 alone (C's fmaf), AVX2 + FMA (the 6 x 16 tile) and, where the CPU runs it,
    AVX-512 without the tile unit (the 8 x 32 tile)."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return ["x86-64", "x86-64-v3", *(["x86-64-v4"] if " avx512f" in flags else [])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_gives_the_same_bits(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(13, 200, generator=g).to(dtype)
    w = torch.randn(75, 200, generator=g).to(dtype)
    lib = cpu.load_library()
    libs = {march: _build(tmp_path, march) for march in _marches()}
    for chunk in (0, cpu.BI_CHUNK):
        builds = {march: _gemm(built, a, w, chunk) for march, built in libs.items()}
        first = builds["x86-64"]
        for march, out in builds.items():
            assert torch.equal(out, first), march
        native = cpu.bi_gemm(a, w.t(), chunk=chunk, out_dtype=torch.float32)
        bf16 = int(dtype == torch.bfloat16)
        if lib.fp4rl_bi_layout(bf16, bf16, chunk) == 0:  # the FMA tile: the same bits
            assert torch.equal(native, first)
        else:  # bf16 on the tile unit (AMX): its own sums, tests/kernels/test_invariant_amx.py
            assert torch.allclose(native, first, rtol=1e-5, atol=1e-5)
