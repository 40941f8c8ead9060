"""Formats as plug-ins: registering one, and the kernels each format object owns.

A format registered from outside the package has no kernel unless it declares one
(``kernels``), so every fast-path entry point declines it and the format's own
reference path does the work.
"""

from __future__ import annotations

import pytest
import torch
from _plugin_formats import MXINT4

import fp4rl
from fp4rl import kernels
from fp4rl.errors import UserError
from fp4rl.formats import FormatError, get_format, list_formats, register_format
from fp4rl.formats.hif4 import HiF4
from fp4rl.kernels import cpu
from fp4rl.kernels.codes import FormatCode
from fp4rl.recovery import parse_pattern, resq_activation, sparsify

BUILTINS = ["hif4", "mxfp4", "nvfp4", "nvfp4_per_token", "nvfp4_4o6", "nvfp4_per_token_4o6",
            "nvfp4_2d", "mxfp8_e4m3", "bf16", "nvfp4_pow2", "nvfp4_static",
            "nvfp4_per_token_pow2", "nvfp4_per_token_4o6_pow2"]


class RenamedHiF4(HiF4):
    """HiF4's arithmetic under another name, counting reference-path calls; its kernels
    are the class's own, so they come with it."""

    name = "hif4_renamed"

    def __init__(self) -> None:
        self.field_calls = 0

    def fields(self, blocks: torch.Tensor, noise: torch.Tensor | None) -> dict[str, torch.Tensor]:
        self.field_calls += 1
        return super().fields(blocks, noise)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.float().view(torch.int32),
                                              b.float().view(torch.int32))


def _heavy_tailed(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))


def test_builtins_register_through_the_same_function():
    assert list_formats() == BUILTINS
    with pytest.raises(FormatError, match="already registered"):
        register_format(HiF4())


def test_plugin_format_quantizes_through_its_reference():
    fmt = register_format(MXINT4())
    assert list_formats() == [*BUILTINS, "mxint4_test"]
    assert get_format("MXINT4_TEST") is fmt
    x = torch.zeros(32)
    x[:3] = torch.tensor([7.0, 3.4, -0.6])  # amax 7: E = 0, elements round to integers
    assert fp4rl.quantize(x, "mxint4_test")[:4].tolist() == [7.0, 3.0, -1.0, 0.0]
    y = _heavy_tailed((6, 70))
    y[2, 40] = float("nan")
    for dim in (0, 1):
        assert _bits_equal(fp4rl.quantize(y, "mxint4_test", dim=dim),
                           fmt.quantize_reference(y, dim=dim))
    z = _heavy_tailed((2, 3, 40), seed=1).bfloat16()
    assert _bits_equal(fp4rl.quantize(z, "mxint4_test", dim=1), fmt.quantize_reference(z, dim=1))
    sr = {"rounding": "stochastic"}
    assert _bits_equal(
        fp4rl.quantize(y, "mxint4_test", generator=torch.Generator().manual_seed(3), **sr),
        fmt.quantize_reference(y, generator=torch.Generator().manual_seed(3), **sr))
    assert _bits_equal(fmt.decode(fmt.encode(y)), fp4rl.quantize(y, "mxint4_test"))


class ReferenceHiF4(RenamedHiF4):
    """A subclass that changes arithmetic must drop the kernels it inherits."""

    name = "hif4_reference"
    kernels = None


@pytest.mark.skipif(cpu.load_library() is None, reason="the C kernel did not build")
def test_kernels_follow_the_format_object_not_its_name():
    renamed, plain = register_format(RenamedHiF4()), register_format(ReferenceHiF4())
    x = _heavy_tailed((9, 130), seed=2)
    for dim in (0, 1):
        expected = fp4rl.quantize(x, "hif4", dim=dim)
        assert _bits_equal(fp4rl.quantize(x, "hif4_renamed", dim=dim), expected)
        assert _bits_equal(fp4rl.quantize(x, "hif4_reference", dim=dim), expected)
    assert renamed.field_calls == 0  # HiF4's kernel ran under the new name
    assert plain.field_calls == 2  # no kernel: the reference, once per dim


def test_fused_resq_declines_a_plugin_and_the_steps_compose():
    register_format(MXINT4())
    x = _heavy_tailed((5, 64), seed=3)
    assert kernels.resq_rows(get_format("mxint4_test"), x, 2, 4) is None
    qx = fp4rl.quantize(x, "mxint4_test")
    expected = qx + sparsify(fp4rl.quantize(x - qx, "mxint4_test"), "2:4")
    got = resq_activation(x, get_format("mxint4_test"), parse_pattern("2:4"))
    assert _bits_equal(got, expected)


def test_registration_refusals():
    register_format(MXINT4())
    with pytest.raises(FormatError, match=r"'mxint4_test' is already registered.*replace=True"):
        register_format(MXINT4())
    replacement = register_format(MXINT4(), replace=True)
    assert get_format("mxint4_test") is replacement
    with pytest.raises(FormatError, match="register an instance"):
        register_format(MXINT4)  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="expects a NumberFormat object, got str"):
        register_format("hif4")  # type: ignore[arg-type]


def test_unknown_name_suggests_the_closest():
    with pytest.raises(FormatError) as err:
        get_format("hif5")
    message = str(err.value)
    assert "did you mean 'hif4'?" in message and "\n" not in message
    assert all(name in message for name in BUILTINS)
    assert isinstance(err.value, UserError)
    register_format(MXINT4())
    with pytest.raises(FormatError, match=r"did you mean 'mxint4_test'\?.*mxint4_test"):
        fp4rl.quantize(torch.ones(4), "mxint4")


def test_no_kernel_for_a_plugin_format(monkeypatch):
    fmt = MXINT4()
    x = _heavy_tailed((4, 64), seed=4)
    assert not any(kernels.has_kernel(fmt, "cpu", axis) for axis in (0, 1))
    assert not kernels.has_matrix_kernel(fmt, x)
    assert kernels.quantize_rows(fmt, x, None) is None
    assert kernels.quantize_matrix(fmt, x, 1, None) is None
    monkeypatch.setenv("FP4RL_KERNELS", "triton")
    assert not kernels.has_kernel(fmt, "cpu")


def test_a_format_declares_only_operations_that_exist():
    with pytest.raises(ValueError, match=r"unknown kernel operations \['rows_fp8'\]"):
        kernels.FormatKernels(FormatCode.HIF4, c=frozenset({"rows", "rows_fp8"}))
    named = kernels.FormatKernels(FormatCode.HIF4, c=frozenset({"rows"}),
                                  triton=frozenset({"cols", "decode"}))
    assert named.c == {kernels.Operation.ROWS}  # a format declared outside: read into members
    assert all(isinstance(op, kernels.Operation) for op in named.c | named.triton)


@pytest.mark.skipif(cpu.load_library() is None, reason="the C kernel did not build")
def test_builtin_formats_own_their_cpu_kernels():
    x = _heavy_tailed((4, 64), seed=5)
    for name in ("hif4", "mxfp4", "nvfp4", "mxfp8_e4m3"):
        fmt = get_format(name)
        assert kernels.has_kernel(fmt, "cpu", 0)
        assert kernels.has_kernel(fmt, torch.device("cpu"), 1)
        assert kernels.has_matrix_kernel(fmt, x)
        no_tensor_scale = {"per_tensor_scale": False} if name == "nvfp4" else {}
        assert _bits_equal(kernels.quantize_rows(fmt, x, None),
                           fmt.quantize_reference(x, **no_tensor_scale))
    hif4, nvfp4 = get_format("hif4"), get_format("nvfp4")
    assert not kernels.has_kernel(get_format("bf16"), "cpu")  # element-wise: no block kernel
    assert not kernels.has_kernel(hif4, "meta")
    assert kernels.resq_rows(hif4, x, 2, 4) is not None
    assert kernels.resq_rows(nvfp4, x, 2, 4) is None  # its per-tensor scale needs two passes
    with pytest.raises(ValueError, match="axis must be 0 or 1"):
        kernels.has_kernel(hif4, "cpu", 2)


@pytest.mark.parametrize("name", list_formats())
def test_the_tensor_scale_trait_says_what_the_format_does(name):
    """``has_tensor_scale`` is what GEMMs and engines read instead of quantizing a probe:
    it must agree with whether the format computes a scale on top of its blocks."""
    fmt = get_format(name)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    assert fmt.has_tensor_scale == (fmt.tensor_scale(x) is not None)
