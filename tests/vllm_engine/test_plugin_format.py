"""A number format registered from a user's own module (one class, one registration)
runs through quantize, encode/decode, the FP4 layer and the vLLM method, with both weight
storages: the method's forward equals the FP4 layer's rollout forward bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

sys.path.insert(0, str(Path(__file__).parent.parent))

from _plugin_formats import MXINT4  # noqa: E402

import fp4rl  # noqa: E402
from fp4rl.formats import register_format  # noqa: E402
from fp4rl.nn import FP4Linear  # noqa: E402
from fp4rl.nn.recipe import get_recipe  # noqa: E402
from fp4rl.rollout.vllm.loading import process  # noqa: E402
from fp4rl.rollout.vllm.method import FP4RLLinearMethod  # noqa: E402


@pytest.fixture(autouse=True)
def _tensor_parallel_one(as_tp_rank):
    as_tp_rank(0, 1)


@pytest.mark.parametrize("storage", ["dequantized", "packed"])
@pytest.mark.parametrize("recovery", ["", "+resq-2:4"])
def test_a_registered_format_serves_in_the_vllm_method(storage, recovery):
    fmt = register_format(MXINT4())
    recipe = get_recipe(f"{fmt.name}{recovery}")
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(fmt.decode(fmt.encode(w)), fp4rl.quantize(w, fmt.name))

    linear = torch.nn.Linear(96, 48, bias=False)
    linear.weight.data.copy_(w)
    ours = FP4Linear.from_linear(linear, recipe)
    with fp4rl.rollout_mode(ours), torch.autocast("cpu", dtype=torch.bfloat16):
        want = ours(x)

    layer = torch.nn.Module()
    method = FP4RLLinearMethod(recipe, seed=ours.seed, storage=storage)
    method.create_weights(layer, 96, [48], 96, 48, torch.bfloat16,
                          weight_loader=lambda p, loaded: p.data.copy_(loaded))
    layer.weight.weight_loader(layer.weight, w)  # FP32, as a trainer sends it
    assert process(layer)
    assert layer.fp4rl.store.storage == storage
    got = method.apply(layer, x)
    assert got.dtype == want.dtype and torch.equal(got, want)
