"""Four Over Six NVFP4 (``nvfp4_4o6``, ``nvfp4_per_token_4o6``) against a plain per-block
loop written from the method's description (arXiv 2512.02010): each block scaled to a
largest magnitude of 6 or 4, whichever leaves the smaller squared error, under a tensor
scale of range 6 * 256."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
import torch

from fp4rl.formats import get_format, quantize

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1(v: float) -> float:
    """Nearest E2M1 magnitude, a tie to the even code (saturating at 6)."""
    best = min(range(len(E2M1)), key=lambda i: (abs(E2M1[i] - v), i % 2))
    return E2M1[best]


def _e4m3(v: float) -> float:
    """E4M3 rounding (nearest, ties to even) of a value already at most 448."""
    return float(torch.tensor(v, dtype=torch.float64).to(torch.float8_e4m3fn).double())


def _block(values: list[float]) -> list[float]:
    amax = max(abs(v) for v in values)
    choices = []
    for top in (6.0, 4.0):
        s = _e4m3(min(amax / top, 448.0))
        q = [math.copysign(_e2m1(abs(v) / s) if s > 0 else 0.0, v) for v in values]
        err = sum((Fraction(qi * s) - Fraction(v)) ** 2 for qi, v in zip(q, values, strict=True))
        choices.append((err, top, [qi * s for qi in q]))
    six, four = choices
    return four[2] if four[0] < six[0] else six[2]


def _slow(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    rows = x.float()
    amax = rows.abs().amax(-1, keepdim=True) if per_token else rows.abs().amax()
    g = (amax.double() / (6 * 256)).float()
    scaled = (rows / g).double().tolist()
    out = [[v for b in range(0, len(r), 16) for v in _block(r[b:b + 16])] for r in scaled]
    return torch.tensor(out, dtype=torch.float64).float() * g


@pytest.mark.parametrize("name", ["nvfp4_4o6", "nvfp4_per_token_4o6"])
def test_equals_a_plain_loop_over_the_blocks(name):
    torch.manual_seed(3)
    x = torch.randn(12, 96) * torch.exp(2 * torch.randn(12, 96))
    expected = _slow(x, per_token=name.startswith("nvfp4_per_token"))
    assert torch.equal(quantize(x, name), expected)
    assert torch.equal(get_format(name).quantize_reference(x), expected)


@pytest.mark.parametrize("seed", range(5))
def test_each_block_errs_no_more_than_nvfp4s(seed):
    """With the same blocks (no tensor scale), Four Over Six picks NVFP4's scale or a
    better one, block by block; and it picks 4 somewhere."""
    torch.manual_seed(seed)
    x = torch.randn(32, 256) * torch.exp(torch.randn(32, 256))
    errs = {n: (quantize(x, n, per_tensor_scale=False) - x).double().square()
            .reshape(-1, 16).sum(-1) for n in ("nvfp4", "nvfp4_4o6")}
    assert (errs["nvfp4_4o6"] <= errs["nvfp4"]).all()
    assert (errs["nvfp4_4o6"] < errs["nvfp4"]).any()


def test_an_nvfp4_decoder_reads_its_codes():
    torch.manual_seed(4)
    x = torch.randn(8, 64) * 5
    packed = get_format("nvfp4_4o6").encode(x)
    as_nvfp4 = dataclasses.replace(packed, format="nvfp4")
    assert torch.equal(get_format("nvfp4").decode(as_nvfp4), quantize(x, "nvfp4_4o6"))


def test_a_weight_takes_the_per_tensor_four_over_six():
    fmt = get_format("nvfp4_per_token_4o6")
    assert fmt.vector_scales and fmt.weight_format == "nvfp4_4o6"
    assert not get_format("nvfp4_4o6").vector_scales
