"""Bit-exact agreement with the golden vectors and with an independent exact oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _oracle import BLOCKS
from _paths import ROOT, TESTS
from hypothesis import given, settings
from hypothesis import strategies as st

import fp4rl

GOLDEN_DIRS = [d for d in (TESTS / "golden", ROOT.parent / "shared" / "golden") if d.is_dir()]
OPTIONS = {"hif4": {}, "mxfp4": {}, "nvfp4": {"per_tensor_scale": False}}


def _cases():
    for root in GOLDEN_DIRS:
        for fmt in OPTIONS:
            archive = np.load(root / f"{fmt}.npz")
            for key in sorted(k[:-2] for k in archive.files if k.endswith("/x")):
                yield pytest.param(fmt, archive[f"{key}/x"], archive[f"{key}/y"],
                                   id=f"{root.parent.name}-{fmt}-{key}")


def _paths(fmt: str):
    f = fp4rl.get_format(fmt)
    return {
        "fast": f.quantize,
        "reference": f.quantize_reference,
        "codec": lambda x, **o: f.decode(f.encode(x, **o)),
        "api": lambda x, **o: fp4rl.quantize(x, fmt, **o),
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


def test_golden_vectors_are_present():
    assert GOLDEN_DIRS, "no golden vectors found"
    for fmt in OPTIONS:
        assert (GOLDEN_DIRS[0] / f"{fmt}.npz").exists()


@pytest.mark.parametrize("path", ["fast", "reference", "codec", "api"])
@pytest.mark.parametrize(("fmt", "x", "y"), list(_cases()))
def test_golden(fmt, x, y, path):
    out = _paths(fmt)[path](torch.from_numpy(x), **OPTIONS[fmt])
    expected = torch.from_numpy(y)
    mismatch = bits(out) != bits(expected)
    assert not mismatch.any(), (
        f"{mismatch.sum()} values differ, e.g. x={torch.from_numpy(x)[mismatch][:4]} "
        f"got {out[mismatch][:4]} want {expected[mismatch][:4]}")


finite_floats = st.floats(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def blocks(draw, size: int):
    """One block of float32 values spanning many octaves, with outliers and exact ties."""
    exponent = draw(st.integers(-140, 120))
    spread = draw(st.integers(0, 30))
    mantissas = draw(st.lists(st.integers(-(2**12), 2**12), min_size=size, max_size=size))
    shifts = draw(st.lists(st.integers(-spread, 0), min_size=size, max_size=size))
    vals = [float(np.float32(m * 2.0 ** (exponent + s - 12)))
            for m, s in zip(mantissas, shifts, strict=True)]
    if draw(st.booleans()):  # sprinkle arbitrary float32 values in
        idx = draw(st.integers(0, size - 1))
        vals[idx] = draw(finite_floats)
    return vals


@pytest.mark.parametrize("fmt", list(BLOCKS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_matches_exact_oracle(fmt, data):
    size, oracle = BLOCKS[fmt]
    rows = [data.draw(blocks(size)) for _ in range(2)]
    x = torch.tensor(rows, dtype=torch.float32)
    want = torch.tensor([oracle(r) for r in rows], dtype=torch.float32)
    for name, path in _paths(fmt).items():
        got = path(x, **OPTIONS[fmt])
        assert torch.equal(bits(got), bits(want)), (name, x, got, want)
