"""The public format API: registry, errors that name the allowed values, real packing."""

from __future__ import annotations

import pytest
import torch

import fp4rl
from fp4rl.formats import FormatError
from fp4rl.formats.packing import pack_bits, pack_nibbles, unpack_bits, unpack_nibbles

EXPECTED = {"hif4": (64, 4.5), "mxfp4": (32, 4.25), "nvfp4": (16, 4.5),
            "mxfp8_e4m3": (32, 8.25), "bf16": (1, 16.0)}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_registry_attributes(name):
    f = fp4rl.formats.get_format(name)
    assert (f.block_size, f.bits_per_value) == EXPECTED[name]
    assert fp4rl.formats.get_format(name.upper()) is f


def test_unknown_format_names_the_choices():
    with pytest.raises(FormatError, match=r"hif4.*mxfp4.*nvfp4"):
        fp4rl.quantize(torch.ones(4), "fp4")


@pytest.mark.parametrize("dim", [2, -3, 5])
def test_dim_out_of_range(dim):
    with pytest.raises(FormatError, match=r"dim=.*out of range.*allowed: -2 \.\. 1"):
        fp4rl.quantize(torch.ones(3, 64), "hif4", dim=dim)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_integer_tensors_rejected(dtype):
    with pytest.raises(FormatError, match=r"x\.float"):
        fp4rl.quantize(torch.ones(64, dtype=dtype), "mxfp4")


def test_float64_rejected_with_allowed_dtypes():
    with pytest.raises(FormatError, match=r"float32, bfloat16, float16"):
        fp4rl.quantize(torch.ones(64, dtype=torch.float64), "mxfp4")


def test_option_not_taken_by_format():
    with pytest.raises(FormatError, match=r"per_tensor_scale.*allowed: rounding, generator"):
        fp4rl.quantize(torch.ones(64), "hif4", per_tensor_scale=False)


def test_bad_rounding_mode():
    with pytest.raises(FormatError, match=r"nearest.*stochastic"):
        fp4rl.quantize(torch.ones(64), "mxfp4", rounding="up")


def test_not_a_tensor():
    with pytest.raises(FormatError, match=r"torch\.Tensor"):
        fp4rl.quantize([1.0, 2.0], "mxfp4")


@pytest.mark.parametrize("fmt", list(EXPECTED))
def test_empty_and_scalar(fmt):
    assert fp4rl.quantize(torch.empty(0, 5), fmt).shape == (0, 5)
    scalar = fp4rl.quantize(torch.tensor(3.3), fmt)
    assert scalar.shape == () and scalar == fp4rl.quantize(torch.tensor([3.3]), fmt)[0]


def test_nvfp4_per_tensor_scale_switch():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 1e-4
    on = fp4rl.quantize(x, "nvfp4")
    off = fp4rl.quantize(x, "nvfp4", per_tensor_scale=False)
    # with tiny values, block-only E4M3 scales underflow to subnormals: far less accurate
    assert (on - x).abs().mean() < 0.5 * (off - x).abs().mean()
    packed = fp4rl.get_format("nvfp4").encode(x)
    assert packed.tensor_scale == pytest.approx(x.abs().max().item() / (6 * 448), rel=1e-6)
    assert packed.metadata_nbytes == 4


@pytest.mark.parametrize("fmt", list(EXPECTED))
@pytest.mark.parametrize("shape,dim", [((8, 256), -1), ((256, 8), 0), ((3, 128, 5), 1)])
def test_storage_matches_bits_per_value(fmt, shape, dim):
    f = fp4rl.formats.get_format(fmt)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    packed = f.encode(x, dim=dim)
    assert packed.nbytes * 8 == x.numel() * f.bits_per_value
    assert all(t.dtype == torch.uint8 for t in packed.fields.values())
    assert torch.equal(f.decode(packed), f.quantize(x, dim=dim))


def test_hif4_field_layout():
    """Per 64 values: 1 E6M2 byte, 1 byte of level-2 bits, 2 of level-3 bits, 32 of codes."""
    packed = fp4rl.formats.get_format("hif4").encode(torch.randn(3, 128))
    sizes = {k: tuple(v.shape) for k, v in packed.fields.items()}
    assert sizes == {"scale": (6,), "level2": (6,), "level3": (6, 2), "codes": (6, 32)}


def test_codes_really_hold_two_values_per_byte():
    """A block of known E2M1 values encodes to the expected nibbles (MXFP4, scale 1)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = torch.cat([grid, -grid, grid, -grid]).reshape(1, 32)
    x[0, 8] = -0.0
    packed = fp4rl.formats.get_format("mxfp4").encode(x)
    assert packed.fields["scale"].item() == 127  # E = floor(log2 6) - 2 = 0
    codes = unpack_nibbles(packed.fields["codes"]).flatten()
    assert codes[:8].tolist() == list(range(8))
    assert codes[8:16].tolist() == [8 + i for i in range(8)]
    assert packed.fields["codes"][0, 0].item() == 0x10  # codes 0 (low) and 1 (high)


def test_nan_block_encodes_as_nan_code():
    x = torch.ones(2, 64)
    x[1, 5] = float("nan")
    hif4 = fp4rl.formats.get_format("hif4")
    packed = hif4.encode(x)
    assert packed.fields["scale"].tolist()[1] == 0xFF
    out = hif4.decode(packed)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()


def test_nibble_and_bit_packing_round_trip():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    bitvals = torch.randint(0, 2, (5, 16), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_bits(pack_bits(bitvals)), bitvals)
    assert pack_bits(torch.tensor([[1, 0, 0, 0, 0, 0, 0, 1]])).item() == 0x81
