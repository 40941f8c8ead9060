"""The fast packing of 2-D weights equals each format's reference: the table decoder bit
for bit (every element code, every scale code, NaN blocks, signed zeros, ragged rows), the
encoder byte for byte."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4rl.formats import get_format
from fp4rl.formats.row_decode import decode_rows
from fp4rl.formats.row_encode import encode_rows
from fp4rl.gemm import PackedOperand, pack_operand, quantize_operand

FORMATS = ("hif4", "mxfp4", "nvfp4", "mxfp8_e4m3")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def wide_range(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows from 1e-30 to 1e30 (every scale code a format reaches), a NaN, a zero row
    and a negative zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-30, 30, rows).unsqueeze(1)
    x[1, 3], x[2, :], x[4, 1] = float("nan"), 0.0, -0.0
    return x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cols", [64, 200, 576])
def test_table_decode_is_the_reference_bit_for_bit(fmt, cols):
    packed = get_format(fmt).encode(wide_range(64, cols, seed=cols), dim=-1)
    assert same_bits(decode_rows(packed), get_format(fmt).decode(packed).float())


@pytest.mark.parametrize("fmt", ("hif4", "mxfp4", "nvfp4"))
def test_every_code_byte_decodes_as_the_reference(fmt):
    """Random bytes in every field: codes no encoder writes still decode alike."""
    layout = PackedOperand.layout(get_format(fmt), 128)
    g = torch.Generator().manual_seed(1)
    fields = {k: torch.randint(0, 256, (32, v.numel()), generator=g, dtype=torch.uint8)
              for k, v in layout.fields.items()}
    op = PackedOperand.from_row_fields(get_format(fmt), (32, 128), fields)
    assert same_bits(decode_rows(op.packed), get_format(fmt).decode(op.packed).float())


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(FORMATS), rows=st.integers(1, 9), cols=st.integers(1, 150),
       scale=st.floats(1e-6, 1e6), seed=st.integers(0, 2**16))
def test_packed_operand_decodes_to_quantize_operand(fmt, rows, cols, scale, seed):
    """``pack_operand`` then decode is ``quantize_operand`` (per-tensor scale outside)."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * scale
    packed, dense = pack_operand(x, get_format(fmt)), quantize_operand(x, get_format(fmt), -1)
    assert torch.equal(packed.decode().values, dense.values)
    assert (packed.scale is None) == (dense.scale is None)
    again = PackedOperand.from_row_fields(get_format(fmt), (rows, cols), packed.row_fields(),
                                          packed.scale)
    assert torch.equal(again.decode().values, dense.values)


@pytest.mark.parametrize("fmt", ("hif4", "mxfp4", "nvfp4"))
@pytest.mark.parametrize("cols", [64, 200, 576])
def test_fast_encode_is_the_reference_byte_for_byte(fmt, cols):
    x = wide_range(64, cols, seed=cols)
    x[5, 2] = float("inf")
    opts = {"per_tensor_scale": False} if fmt == "nvfp4" else {}
    want = get_format(fmt).encode(x, dim=-1, **opts)
    got = encode_rows(fmt, x)
    assert got is not None and got.options == want.options and got.shape == want.shape
    assert sorted(got.fields) == sorted(want.fields)
    for name, buffer in want.fields.items():
        assert torch.equal(got.fields[name], buffer), name


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(("hif4", "mxfp4", "nvfp4")), rows=st.integers(1, 5),
       cols=st.integers(1, 130), scale=st.floats(1e-30, 1e30), seed=st.integers(0, 2**16))
def test_fast_encode_matches_the_reference_on_any_rows(fmt, rows, cols, scale, seed):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * scale
    opts = {"per_tensor_scale": False} if fmt == "nvfp4" else {}
    want = get_format(fmt).encode(x, dim=-1, **opts)
    got = encode_rows(fmt, x)
    assert all(torch.equal(got.fields[k], v) for k, v in want.fields.items())
