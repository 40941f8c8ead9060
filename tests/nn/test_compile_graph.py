"""``torch.compile`` sees an FP4Linear as one graph, in training and in rollout, inside
and outside :func:`fp4rl.nn.hold_weights`: the kernels are custom operators (the C
library's on a CPU, Triton's on a GPU), the scopes it reads (a static NVFP4 scale, the
real token rows) are thread-locals a graph reads and guards on, and the kept ``Q(W)``'s
version key is left to eager calls. The compiled layer gives the eager layer's bits."""

from __future__ import annotations

import contextlib

import pytest
import torch

from fp4rl.nn import hold_weights
from fp4rl.nn.invariant import tokens_fed
from fp4rl.nn.linear import FP4Linear, Mode
from fp4rl.nn.recipe import get_recipe

RECIPES = ["hif4", "nvfp4", "nvfp4_static", "nvfp4_per_token", "miles-nvfp4", "nemo-rl-nvfp4",
           "torchao-nvfp4", "mxfp4:fp4-reuse/w4a16", "hif4+resq-2:4", "hif4+resqw-2:4"]


def _layer(recipe: str, mode: Mode) -> FP4Linear:
    torch.manual_seed(0)
    layer = FP4Linear(64, 48, recipe=get_recipe(recipe))
    layer.mode = mode
    return layer


@pytest.mark.parametrize("mode", [Mode.TRAIN, Mode.ROLLOUT])
@pytest.mark.parametrize(("recipe", "held"), [(r, True) for r in RECIPES] +
                         [("hif4", False), ("nvfp4_static", False)])
def test_no_graph_break(recipe, mode, held):
    layer = _layer(recipe, mode)
    x = torch.randn(2, 5, 64, requires_grad=mode is Mode.TRAIN)
    mask = torch.tensor([True] * 8 + [False] * 2)
    torch._dynamo.reset()
    with hold_weights(layer) if held else contextlib.nullcontext(), tokens_fed(mask):
        explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("mode", [Mode.TRAIN, Mode.ROLLOUT])
@pytest.mark.parametrize("recipe", ["hif4", "nvfp4_static", "miles-nvfp4"])
def test_compiled_layer_gives_the_eager_bits(recipe, mode):
    layer = _layer(recipe, mode)
    x = torch.randn(6, 64)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    outputs = []
    for run in (layer, compiled):
        layer.begin_step()  # the static scale is fixed afresh by each side's forward
        xi = x.clone().requires_grad_(mode is Mode.TRAIN)
        with hold_weights(layer):
            y = run(xi)
            if mode is Mode.TRAIN:
                y.square().sum().backward()
        grads = (xi.grad, layer.weight.grad) if mode is Mode.TRAIN else ()
        outputs.append((y.detach(), *(g.clone() for g in grads)))
        layer.weight.grad = None
    for eager, graph in zip(*outputs, strict=True):
        assert torch.equal(eager, graph)


@pytest.mark.parametrize("mode", [Mode.TRAIN, Mode.ROLLOUT])
@pytest.mark.parametrize("recipe", ["hif4", "nvfp4_static"])
def test_no_graph_break_on_the_triton_path(recipe, mode, monkeypatch):
    """The path a GPU takes (its kernels interpreted here: tests/conftest.py)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("FP4RL_KERNELS", "triton")
    test_no_graph_break(recipe, mode, True)
