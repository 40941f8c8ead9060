"""The public names docs/design.md promises, importable and doing what they say."""

from __future__ import annotations

import torch

import fp4rl
from fp4rl import formats, recovery


def test_design_names_exist():
    for name in ("quantize", "quantize_model", "rollout_mode", "train_mode", "get_format"):
        assert callable(getattr(fp4rl, name))
    assert callable(formats.get_format)
    for name in ("sparsify", "resq_matmul"):
        assert callable(getattr(recovery, name))


def test_resq_matmul_is_the_papers_formula():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 64, generator=g), torch.randn(5, 64, generator=g)
    qx = fp4rl.quantize(x, "hif4")
    qw = fp4rl.quantize(w, "hif4")
    expected = qx @ qw.t() + recovery.sparsify(fp4rl.quantize(x - qx, "hif4"), "2:4") @ qw.t()
    got = recovery.resq_matmul(x, w, "hif4", "2:4", two_gemm=True)
    assert torch.equal(got, expected)
    kept = recovery.sparsify(x, "2:4").reshape(6, 16, 4)
    assert ((kept != 0).sum(-1) <= 2).all()
