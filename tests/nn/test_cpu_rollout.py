"""The rollout GEMM's kernels chosen once per weight version on a CPU (``CpuRollout``) give
the general path's bits, and step aside wherever the general path must run."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fp4rl.kernels import cpu, cpu_ops
from fp4rl.nn import FP4Linear, get_recipe, hold_weights
from fp4rl.nn.cpu_rollout import CpuRollout
from fp4rl.nn.invariant import batch_invariant
from fp4rl.nn.linear import Mode
from fp4rl.precision import autocast

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="needs the C kernels")

PLANNED = ("hif4", "mxfp4", "hif4+resq-2:4", "hif4+resq-dense", "mxfp4+resq-2:4")


def _layer(recipe: str, bias: bool, d: int = 320, n: int = 40) -> FP4Linear:
    torch.manual_seed(0)
    layer = FP4Linear.from_linear(nn.Linear(d, n, bias=bias), get_recipe(recipe))
    layer.mode = Mode.ROLLOUT
    return layer


def _general(layer: FP4Linear, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch
             ) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(FP4Linear, "_cpu_rollout", lambda self, x2, dtype: None)
        return layer(x)


@pytest.mark.parametrize("recipe", PLANNED)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 70])
def test_the_kept_kernels_give_the_general_paths_bits(recipe, bias, x_dtype, rows,
                                                      monkeypatch):
    layer = _layer(recipe, bias)
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 1, 320, generator=g) * 3).to(x_dtype)
    x[0, 0, :5] = 0  # a block partly zero
    gemms: list[tuple[int, tuple[int, ...]]] = []  # ResQ's fp32-output GEMMs: order, rows
    real = cpu.bi_gemm
    monkeypatch.setattr(cpu, "bi_gemm", lambda a, b, **kw: gemms.append(
        (kw["chunk"], tuple(a.shape))) or real(a, b, **kw))
    with torch.no_grad(), autocast(x.device, torch.bfloat16), hold_weights(layer):
        fast = layer(x)
        assert isinstance(layer._kept.cpu_rollout, CpuRollout)  # it was taken
        assert torch.equal(fast, _general(layer, x, monkeypatch))
        with batch_invariant():  # the mode's fixed order: ResQ's runs of 64 k's
            assert torch.equal(layer(x), _general(layer, x, monkeypatch))
    assert fast.dtype == torch.bfloat16 and fast.shape == (rows, 1, 40)
    # the same GEMM calls, in the same order, as the general path (an FP4 sum of 320
    # products is mostly exact in fp32, so the bits alone would not show the order)
    assert gemms[0::2] == gemms[1::2]
    assert len(gemms) == (4 if "resq" in recipe else 0)


def test_a_new_weight_version_or_a_received_weight_makes_a_new_plan(monkeypatch):
    layer = _layer("hif4+resq-2:4", False)
    x = torch.randn(5, 320).bfloat16()
    with torch.no_grad(), autocast(x.device, torch.bfloat16), hold_weights(layer):
        before = layer(x)
        plan = layer._kept.cpu_rollout
        layer.weight.mul_(2)  # an in-place write the version key sees
        after = layer(x)
        assert layer._kept.cpu_rollout is not plan
        assert not torch.equal(before, after)
        assert torch.equal(after, _general(layer, x, monkeypatch))
        layer.receive_rollout_weight(layer.rollout_weight(torch.bfloat16))
        assert layer._kept.cpu_rollout is None


def test_a_new_bias_is_read_at_the_call(monkeypatch):
    """The plan is kept for the weight's version, which a new bias does not change."""
    layer = _layer("hif4", True)
    x = torch.randn(5, 320).bfloat16()
    with torch.no_grad(), autocast(x.device, torch.bfloat16), hold_weights(layer):
        before = layer(x)
        layer.bias = nn.Parameter(layer.bias.detach() + 1)
        after = layer(x)
        assert isinstance(layer._kept.cpu_rollout, CpuRollout)
        assert not torch.equal(before, after)
        assert torch.equal(after, _general(layer, x, monkeypatch))


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4+resq-2:4", "mxfp4+smoothquant",
                                    "hif4+resq-channel:0.5", "hif4+resq-2:128"])
def test_other_policies_keep_the_general_path(recipe):
    # n:m groups wider than the C kernel takes (dispatch's rule, asked through resq_is_c)
    layer = _layer(recipe, False, d=384)
    x = torch.randn(5, 384).bfloat16()
    with torch.no_grad(), autocast(x.device, torch.bfloat16), hold_weights(layer):
        layer(x)
        assert not isinstance(layer._kept.cpu_rollout, CpuRollout)


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_calls_the_kernels_may_not_take_directly_go_the_general_way(monkeypatch):
    layer = _layer("hif4", False)
    x = torch.randn(5, 320).bfloat16()
    taken = []
    real = CpuRollout.__call__
    monkeypatch.setattr(CpuRollout, "__call__",
                        lambda self, x2, bias: taken.append(1) or real(self, x2, bias))
    with autocast(x.device, torch.bfloat16), hold_weights(layer):
        with torch.no_grad():
            layer(x)
        assert taken == [1]
        layer(x.requires_grad_())  # a gradient asked for: the general path under no_grad
        assert taken == [1, 1]  # the rollout forward itself turns grad off first
        with torch.no_grad(), _Seen() as seen:  # a mode that must see every operator
            layer(x.detach())
        assert taken == [1, 1] and "fp4rl.c_quantize_bf16.default" in seen.ops
    with torch.no_grad(), autocast(x.device, torch.bfloat16):
        layer(x.detach())  # outside a weight scope nothing is kept
    assert taken == [1, 1]
