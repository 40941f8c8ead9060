"""The device-discipline tier for the vLLM method: a layer's whole life cycle with the
layer on the ``meta`` device, standing in for a GPU (see tests/kernels/test_device_discipline.py).

Create, vLLM's ``dummy`` start, a load from a checkpoint (FP32 masters as verl sends them,
and bf16), a load of an fp4rl export's packed fields (which vLLM's loader hands over as
CPU tensors), processing, the forward, and a refit from each wire (whose tensors arrive on
the CPU when the engine core runs in its own process): every store and every output stays
on the layer's device. vLLM's tensor-parallel group is not started here; the layer is
tensor-parallel 1, as vLLM's parameters ask it.
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from fp4rl.formats import get_format  # noqa: E402
from fp4rl.gemm import Operand, PackedOperand, pack_operand  # noqa: E402
from fp4rl.nn.recipe import get_recipe  # noqa: E402
from fp4rl.rollout.vllm.errors import VLLMError  # noqa: E402
from fp4rl.rollout.vllm.loading import install, process  # noqa: E402
from fp4rl.rollout.vllm.method import FP4RLLinearMethod  # noqa: E402
from fp4rl.rollout.vllm.stores import DequantizedStore  # noqa: E402

META = torch.device("meta")
IN, PARTS = 128, [32, 16, 16]  # a merged q/k/v layer


@pytest.fixture(autouse=True)
def _tensor_parallel_one(as_tp_rank):
    as_tp_rank(0, 1)


def _merged_loader(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """What vLLM's merged linear loader does at tensor-parallel 1: rows of one part."""
    if shard_id is None:
        param.data.copy_(loaded)
        return
    index = "qkv".index(shard_id) if isinstance(shard_id, str) else shard_id
    start = sum(PARTS[:index])
    param.data[start:start + PARTS[index]].copy_(loaded)


def _layer(recipe: str, storage: str) -> torch.nn.Module:
    layer = torch.nn.Module()
    method = FP4RLLinearMethod(get_recipe(recipe), seed=0, storage=storage)
    with torch.device(META):  # vLLM builds its model under the target device
        method.create_weights(layer, IN, list(PARTS), IN, sum(PARTS), torch.bfloat16,
                              weight_loader=_merged_loader)
    layer.method = method
    return layer


def _store_on_meta(layer: torch.nn.Module) -> None:
    store = layer.fp4rl.store
    assert store is not None
    tensors = store.tensors()
    assert tensors and all(t.device == META for t in tensors), \
        [t.device for t in tensors]
    y = layer.method.apply(layer, torch.empty(3, IN, device=META, dtype=torch.bfloat16))
    assert y.device == META and y.shape == (3, sum(PARTS))


CASES = [(r, s) for r in ("hif4+resq-2:4", "mxfp4", "nvfp4", "nvfp4+resq-2:4")
         for s in ("dequantized", "packed")]


@pytest.mark.parametrize(("recipe", "storage"), CASES)
def test_dummy_start_then_checkpoint_loads(recipe, storage):
    layer = _layer(recipe, storage)
    process(layer)  # vLLM's dummy load format: nothing loaded
    _store_on_meta(layer)
    for dtype in (torch.float32, torch.bfloat16):  # verl's FP32 masters; a bf16 checkpoint
        for i, shard in enumerate("qkv"):
            layer.weight.weight_loader(layer.weight,
                                       torch.empty(PARTS[i], IN, device=META, dtype=dtype),
                                       shard)
        # a built engine quantizes the layer, and frees the staged weight, as its last
        # part arrives (a bucketed sync stages a layer at a time): vLLM's processing after
        # the loads finds nothing new
        assert layer.weight.numel() == 0 and not layer.fp4rl.written
        assert not process(layer)
        _store_on_meta(layer)


@pytest.mark.parametrize(("recipe", "storage"), CASES)
def test_an_exports_packed_fields_land_on_the_layers_device(recipe, storage):
    """vLLM's loader reads an export's safetensors on the CPU and hands them over."""
    layer = _layer(recipe, storage)
    fmt = layer.fp4rl.fmt
    for i, shard in enumerate("qkv"):
        part = pack_operand(torch.randn(PARTS[i], IN), fmt)  # on the CPU, as loaded
        fields = dict(part.row_fields())
        if part.scale is not None:
            fields["tensor_scale"] = part.scale.reshape(1)  # as an export stores it
        for name, value in fields.items():
            param = getattr(layer, f"weight_{name}")
            param.weight_loader(param, value, shard)
    assert process(layer)
    _store_on_meta(layer)


@pytest.mark.parametrize(("recipe", "storage"), CASES)
@pytest.mark.parametrize("wire", ["packed", "bf16"])
def test_refits_from_either_wire_stay_on_the_layers_device(recipe, storage, wire):
    """A refit's tensors come off the wire on the CPU (the engine core in its own
    process); each refit after the first writes into the same tensors."""
    if storage == "packed" and wire == "bf16":
        pytest.skip("a packed store takes the packed wire only (refused: test_refit.py)")
    layer = _layer(recipe, storage)
    process(layer)
    fmt = layer.fp4rl.fmt
    for step in range(2):
        parts = []
        for rows in PARTS:
            p = pack_operand(torch.randn(rows, IN), fmt)
            parts.append(p if wire == "packed" else p.decode(torch.bfloat16))
        install(layer, parts)
        before = [t for t in layer.fp4rl.store.tensors()]
        assert process(layer)
        _store_on_meta(layer)
        if step:
            assert all(a is b for a, b in zip(before, layer.fp4rl.store.tensors(),
                                              strict=True))


def test_a_compiled_store_refuses_a_layout_change():
    """A compiled engine's forward (and its CUDA graphs) read the tensors they traced:
    a refit that would swap in tensors of another shape, dtype or device is refused, not
    installed beside the ones the graph reads."""
    old = DequantizedStore.of([Operand(torch.zeros(8, 64, dtype=torch.bfloat16))],
                              torch.bfloat16, prepack=False)
    for new_values in (torch.zeros(8, 64, dtype=torch.float32),
                       torch.zeros(8, 64, dtype=torch.bfloat16, device=META),
                       torch.zeros(4, 64, dtype=torch.bfloat16)):
        new = DequantizedStore.of([Operand(new_values)], new_values.dtype, prepack=False)
        with pytest.raises(VLLMError, match="changed the layout of a compiled engine"):
            old.refilled(new, in_place=True)
        assert old.refilled(new) is new  # an eager engine takes the new tensors
    same = DequantizedStore.of([Operand(torch.ones(8, 64, dtype=torch.bfloat16))],
                               torch.bfloat16, prepack=False)
    assert old.refilled(same, in_place=True) is old
    assert torch.equal(old.tensors()[0], same.tensors()[0])


def test_nvfp4_refit_scale_keeps_the_stores_shape():
    """The per-tensor scale arrives as the 0-dim tensor the store holds, so a compiled
    NVFP4 engine takes its refits in place."""
    from fp4rl.rollout.vllm.refit import RefitPayload

    p = pack_operand(torch.randn(16, IN), get_format("nvfp4"))
    back = RefitPayload.from_wire(RefitPayload({"x": p}, []).to_wire(as_bytes=True))
    got = back.grids["x"]
    assert isinstance(got, PackedOperand) and got.scale.shape == p.scale.shape == ()
    assert torch.equal(got.scale, p.scale)
