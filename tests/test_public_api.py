"""The public names the README and docs/architecture.md promise, importable and doing what
they say."""

from __future__ import annotations

import pytest
import torch

import fp4rl
from fp4rl import formats, recovery


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4", "nvfp4", "mxfp8_e4m3", "bf16"])
def test_quantize_is_the_formats_own_along_any_axis(fmt):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 3
    f = formats.get_format(fmt)
    assert torch.equal(fp4rl.quantize(x, fmt), f.quantize(x, -1))
    assert torch.equal(fp4rl.quantize(x.t().contiguous(), fmt, dim=0), f.quantize(x, -1).t())
    assert torch.equal(f.decode(f.encode(x, -1)), f.quantize(x, -1))


def _two_of_four(r: torch.Tensor) -> torch.Tensor:
    """S of the paper, one group of four at a time: the two largest magnitudes kept (ties
    to the earlier position), the others zeroed."""
    out = torch.zeros_like(r)
    for i in range(r.shape[0]):
        for start in range(0, r.shape[1], 4):
            group = [(-abs(float(r[i, j])), j) for j in range(start, start + 4)]
            for _, j in sorted(group)[:2]:
                out[i, j] = r[i, j]
    return out


def test_resq_matmul_is_the_papers_formula():
    """Q(x)Q(w)^T + S(Q(x - Q(x)))Q(w)^T, computed here from the format's plain reference
    quantizer, a loop for the 2:4 selection and float64 products, against the fused
    activation and the library's two-GEMM and one-GEMM forms."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 64, generator=g), torch.randn(5, 64, generator=g)
    q = formats.get_format("hif4").quantize_reference
    qx, qw = q(x), q(w)
    activation = qx + _two_of_four(q(x - qx))
    hif4, two_of_four = formats.get_format("hif4"), recovery.parse_pattern("2:4")
    assert torch.equal(recovery.resq_activation(x, hif4, two_of_four), activation)
    expected = (qx.double() @ qw.double().t()
                + _two_of_four(q(x - qx)).double() @ qw.double().t())
    for two_gemm in (True, False):
        got = recovery.resq_matmul(x, w, "hif4", "2:4", two_gemm=two_gemm)
        torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-5)
    kept = recovery.sparsify(x, "2:4").reshape(6, 16, 4)
    assert ((kept != 0).sum(-1) <= 2).all()
