"""The batch-invariant GEMM gives the same bits whatever vector ISA and register tile it
is compiled for: every output is one sequence of float32 operations, which the tile and
the vector width only schedule. A machine with AVX-512, one with AVX2 only and one with
SSE alone then score a token alike."""

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
    b = w.t()
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)
    bf16 = int(a.dtype == torch.bfloat16)
    assert lib.fp4rl_bi_gemm(1, a.shape[0], b.shape[1], a.shape[1],
                             a.data_ptr(), bf16, 0, a.stride(0), a.stride(1),
                             b.data_ptr(), bf16, 0, b.stride(0), b.stride(1),
                             None, out.data_ptr(), bf16, 0, out.stride(0), chunk, 2) == 0
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_gives_the_same_bits(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(13, 200, generator=g).to(dtype)
    w = torch.randn(75, 200, generator=g).to(dtype)
    for chunk in (0, cpu.BI_CHUNK):
        native = cpu.bi_gemm(a, w.t(), chunk=chunk)
        for march in ("x86-64", "x86-64-v3"):  # SSE2 alone; AVX2 (the 16-column tile)
            assert torch.equal(_gemm(_build(tmp_path, march), a, w, chunk), native), march
