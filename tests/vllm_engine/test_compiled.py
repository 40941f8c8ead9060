"""The ``fp4rl`` method in vLLM's compiled mode (``enforce_eager=False``: torch.compile of
the whole model, and CUDA graphs on GPUs).

vLLM traces the model with ``fullgraph=True``, so an engine that starts has traced through
every fp4rl layer. Layer by layer the compiled forward equals the eager one bit for bit;
a refit writes into the tensors the compiled graph reads (vLLM calls it without guards,
and a CUDA graph replays fixed addresses), so it must not move them."""

from __future__ import annotations

import gc

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from _engines import fp4_layers  # noqa: E402

import fp4rl  # noqa: E402
from fp4rl.integrations.vllm import EngineSpec, make_llm, refit  # noqa: E402
from fp4rl.models import load_model  # noqa: E402
from fp4rl.nn.recipe import get_recipe  # noqa: E402

KINDS = ("self_attn.qkv_proj", "mlp.down_proj")


@pytest.mark.parametrize("storage", ["dequantized", "packed"])
@pytest.mark.parametrize("recipe", ["hif4+resq-2:4", "nvfp4", "nvfp4_per_token"])
def test_each_layer_compiles_whole_to_the_eager_bits(smollm_dir, recipe, storage):
    model, _ = load_model("smollm2-135m")
    fp4rl.quantize_model(model, recipe)
    llm = make_llm(EngineSpec(smollm_dir, get_recipe(recipe), max_model_len=128,
                              kv_cache_bytes=64 << 20, weight_storage=storage))
    refit(llm, model, packed=True)
    layers = fp4_layers(llm)
    for kind in KINDS:
        torch._dynamo.reset()
        layer = layers[f"model.layers.5.{kind}"]
        compiled = torch.compile(lambda x, layer=layer: layer.quant_method.apply(layer, x),
                                 fullgraph=True, dynamic=True)
        with torch.inference_mode():
            for rows in (7, 2):
                x = torch.randn(rows, layer.fp4rl.in_features).bfloat16()
                assert torch.equal(compiled(x), layer.quant_method.apply(layer, x)), kind
    del llm
    gc.collect()


@pytest.mark.long
def test_a_compiled_engine_is_refit_in_place():
    """A compiled engine (about a minute of compiling on a CPU) serves fp4rl's layers
    without vLLM's prepacked weights (rebuilt at a refit), and a refit with other weights
    leaves every stored tensor where the compiled graph reads it, holding the new ``Q(W)``
    (the layer equals the refit of a fresh eager engine bit for bit), and changes what the
    engine generates."""
    from vllm import SamplingParams

    from fp4rl.integrations.vllm import model_dir

    recipe = "hif4+resq-2:4"
    model, _ = load_model("smollm2-135m")
    fp4rl.quantize_model(model, recipe)
    spec = EngineSpec(model_dir("smollm2-135m"), get_recipe(recipe), max_model_len=128,
                      kv_cache_bytes=64 << 20, enforce_eager=False)
    llm = make_llm(spec)
    refit(llm, model, packed=True)
    layers = fp4_layers(llm)
    assert layers and all(not m.fp4rl.prepack for m in layers.values())
    addresses = {n: [t.data_ptr() for t in m.fp4rl.store.tensors()] for n, m in layers.items()}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    prompts = ["Question: what is 3 + 7? Answer:", "Tom has 4 apples and buys 9 more."]

    def generate(engine) -> list[list[float]]:
        out = engine.generate(prompts, params, use_tqdm=False)
        rows = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                 strict=True)] for o in out]
        assert all(torch.isfinite(torch.tensor(r)).all() for r in rows)
        return rows

    before = generate(llm)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.25)
    refit(llm, model, packed=True)
    assert {n: [t.data_ptr() for t in m.fp4rl.store.tensors()]
            for n, m in layers.items()} == addresses
    assert generate(llm) != before
    eager = make_llm(EngineSpec(spec.model_dir, get_recipe(recipe), max_model_len=128,
                                kv_cache_bytes=64 << 20, enforce_eager=True))
    refit(eager, model, packed=True)
    reference = fp4_layers(eager)
    with torch.inference_mode():
        for kind in KINDS:
            name = f"model.layers.9.{kind}"
            x = torch.randn(5, layers[name].fp4rl.in_features).bfloat16()
            assert torch.equal(layers[name].quant_method.apply(layers[name], x),
                               reference[name].quant_method.apply(reference[name], x)), kind
    del llm, eager
    gc.collect()
