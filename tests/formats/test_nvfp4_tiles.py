"""``nvfp4_2d``: NVFP4 with one E4M3 scale per 16 x 16 tile of a matrix, against a plain
loop over the tiles written from the rule (NVFP4's block rule applied to a tile's 256
values, under NVFP4's per-tensor scale)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp4rl.formats import get_format, quantize

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1(v: float) -> float:
    return E2M1[min(range(len(E2M1)), key=lambda i: (abs(E2M1[i] - v), i % 2))]


def _slow(w: torch.Tensor) -> torch.Tensor:
    g = (w.abs().amax().double() / (6 * 448)).float()
    scaled = (w / g).double()
    out = torch.zeros_like(scaled)
    for r in range(0, w.shape[0], 16):
        for c in range(0, w.shape[1], 16):
            tile = scaled[r:r + 16, c:c + 16]
            s = float((tile.abs().max() / 6).clamp(max=448).to(torch.float8_e4m3fn).double())
            q = tile.abs().apply_(lambda v, s=s: _e2m1(v / s) if s > 0 else 0.0)
            out[r:r + 16, c:c + 16] = torch.copysign(q * s, tile)
    return out.float() * g


@pytest.mark.parametrize("shape", [(32, 48), (40, 72), (7, 16)])
def test_equals_a_plain_loop_over_the_tiles_along_either_axis(shape):
    torch.manual_seed(5)
    w = torch.randn(*shape) * torch.exp(torch.randn(*shape))
    expected = _slow(w)
    assert torch.equal(quantize(w, "nvfp4_2d"), expected)
    assert torch.equal(quantize(w, "nvfp4_2d", dim=0), expected)  # Q(W^T) = Q(W)^T
    assert torch.equal(get_format("nvfp4_2d").quantize_reference(w.t().contiguous()),
                       expected.t())


def test_its_packed_rows_are_nvfp4s():
    torch.manual_seed(6)
    w = torch.randn(40, 72)
    packed = get_format("nvfp4_2d").encode(w)
    assert torch.equal(get_format("nvfp4").decode(dataclasses.replace(packed, format="nvfp4")),
                       quantize(w, "nvfp4_2d"))
    scales = packed.fields["scale"].reshape(40, -1)
    assert torch.equal(scales[:16], scales[:1].expand(16, -1))  # one scale a tile


def test_a_non_finite_value_spoils_its_tile_only():
    w = torch.ones(32, 32)
    w[3, 20] = torch.nan
    q = quantize(w, "nvfp4_2d")
    assert q[:16, 16:].isnan().all() and not q[16:].isnan().any() and not q[:, :16].isnan().any()
