"""The batch-invariant GEMM's Triton kernel, without a GPU: interpreted (a row's bits do
not depend on the rows beside it), compiled for sm_90 and sm_100, and traced on ``meta``
through the batch-invariant mode (``fp4rl::bi_mm``, shapes and devices)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from fp4rl.kernels import triton_invariant
from fp4rl.nn.invariant import batch_invariant

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(70, 100, generator=g).to(dtype)  # two row tiles, a partial K step
    w = torch.randn(90, 100, generator=g).to(dtype)
    bias = torch.randn(90, generator=g).to(dtype)
    together = triton_invariant.bi_mm(a, w.t(), bias)
    for i in (0, 37, 69):
        assert torch.equal(triton_invariant.bi_mm(a[i:i + 1], w.t(), bias)[0], together[i])
    assert torch.equal(triton_invariant.bi_mm(a[30:], w.t(), bias), together[30:])
    ref = a.double() @ w.double().t() + bias.double()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(together.double(), ref, rtol=tol, atol=tol * 10)


_COMPILE = """
import json
from fp4rl.kernels import aot, triton_invariant
done = aot.compile_all(list(triton_invariant.variants()), processes=1)
print(json.dumps([[c.kernel, c.target, c.cubin_bytes, c.error[:300], c.fp64, c.local]
                  for c in done]))
"""


def test_every_variant_compiles_for_hopper_and_blackwell():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    done = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(done) == len(list(triton_invariant.variants())) * 2 == 18 * 2
    assert [d for d in done if d[3] or d[2] <= 0] == []
    # the SASS read: no float64 instruction and no local memory (a register spill)
    assert [d for d in done if d[4] != 0 or d[5] != 0] == []


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_on_a_gpu_device_the_mode_routes_gemms_to_the_kernel(dtype):
    """On ``meta`` (a GPU's stand-in here) every GEMM of a linear, and attention's batched
    ones, reach ``fp4rl::bi_mm`` with their shapes; nothing reads a value back."""
    x = torch.empty(5, 64, device="meta", dtype=dtype)
    layer = torch.nn.Linear(64, 32, device="meta", dtype=dtype)
    q = torch.empty(2, 5, 16, device="meta", dtype=dtype)
    with _Ops() as ops, batch_invariant():
        y = layer(x)
        scores = torch.bmm(q, q.transpose(1, 2))
        plain = x @ layer.weight.t()
    assert y.shape == (5, 32) and scores.shape == (2, 5, 5) and plain.shape == (5, 32)
    assert y.device.type == "meta" and y.dtype == dtype
    assert ops.seen.count("fp4rl.bi_mm.default") == 2
    assert ops.seen.count("fp4rl.bi_bmm.default") == 1
    assert not any(op.startswith(("aten.mm", "aten.addmm", "aten.bmm")) for op in ops.seen)
