"""Refit: the trainer's Q(W) handed to a running engine gives what a fresh engine gives,
through vLLM's worker interface, with the engine core in this process or in its own."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from fp4rl.cli import main  # noqa: E402
from fp4rl.integrations.vllm import EngineSpec, make_llm, refit, refit_payload  # noqa: E402
from fp4rl.models import load_model  # noqa: E402
from fp4rl.nn import fp4_layers, quantize_model  # noqa: E402
from fp4rl.nn.recipe import get_recipe  # noqa: E402

RECIPE = "hif4+resq-2:4"
PROMPTS = ["Question: what is 3 + 7? Answer:", "Tom has 4 apples and buys 9 more. How many?"]


def prompt_logprobs(llm, tok) -> list[list[dict[int, float]]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    outs = llm.generate([TokensPrompt(prompt_token_ids=tok(p)["input_ids"]) for p in PROMPTS],
                        params, use_tqdm=False)
    return [[{t: lp.logprob for t, lp in d.items()} for d in [*o.prompt_logprobs[1:],
                                                               *o.outputs[0].logprobs]]
            for o in outs]


def updated_model(seed: int = 0):
    """The embedded model, patched, after an update of the size a few optimizer steps
    make, to every parameter (the embeddings too: the LM head is tied to them)."""
    model, tok = load_model("smollm2-135m")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01 * p.abs().mean())
    quantize_model(model, RECIPE)
    return model, tok


@pytest.mark.slow
def test_the_payload_is_the_rollout_q_w_bit_for_bit_and_at_most_bf16_bytes():
    model, _ = updated_model()
    bf16_bytes = sum(p.numel() * 2 for p in model.parameters())
    grid = refit_payload(model, torch.bfloat16)
    packed = refit_payload(model, torch.bfloat16, packed=True)
    layers = fp4_layers(model)
    assert set(grid.grids) == set(packed.grids) == set(layers)
    for name, layer in list(layers.items())[:8]:
        want = layer.rollout_weight(torch.float32).values
        assert torch.equal(grid.grids[name].values.float(), want), name
        assert torch.equal(packed.grids[name].decode().values, want), name
    assert grid.nbytes == bf16_bytes  # Q(W) exact in bf16, the rest in bf16
    assert packed.nbytes <= 0.5 * bf16_bytes
    assert all(t.dtype == torch.bfloat16 for _, t in grid.tensors)


def test_refit_equals_a_fresh_engine_on_the_export_of_the_new_weights(smollm_dir, tmp_path):
    model, tok = updated_model()
    spec = EngineSpec(smollm_dir, get_recipe(RECIPE), dtype=torch.bfloat16, max_model_len=256,
                      kv_cache_bytes=256 << 20)
    llm = make_llm(spec)
    before = prompt_logprobs(llm, tok)
    stats = refit(llm, model)
    after = prompt_logprobs(llm, tok)
    again = refit(llm, model)  # safe on every step: the same weights, the same engine
    assert prompt_logprobs(llm, tok) == after
    del llm
    gc.collect()
    assert stats.bytes == sum(p.numel() * 2 for p in model.parameters())
    assert stats.tensors == again.tensors == len(list(model.parameters())) and stats.seconds > 0
    assert after != before  # the engine serves the new weights

    # the export carries the same Q(W) of the FP32 masters, packed
    model.save_pretrained(tmp_path / "new")
    tok.save_pretrained(tmp_path / "new")
    assert main(["export", "--model", str(tmp_path / "new"), "--format", "vllm", "--recipe",
                 RECIPE, "--output", str(tmp_path / "served")]) == 0
    fresh = make_llm(EngineSpec(str(tmp_path / "served"), get_recipe(RECIPE),
                                dtype=torch.bfloat16, max_model_len=256,
                                kv_cache_bytes=256 << 20))
    assert prompt_logprobs(fresh, tok) == after
    del fresh
    gc.collect()


CHILD = """
import json, os, sys, torch
sys.path.insert(0, {tests!r})
from test_refit import RECIPE, prompt_logprobs, updated_model
from fp4rl.integrations.vllm import EngineSpec, make_llm, refit
from fp4rl.integrations.vllm import engine_model
from fp4rl.nn.recipe import get_recipe
if __name__ == "__main__":
    model, tok = updated_model()
    llm = make_llm(EngineSpec({model_dir!r}, get_recipe(RECIPE), dtype=torch.bfloat16,
                              max_model_len=256, kv_cache_bytes=256 << 20))
    stats = refit(llm, model, packed=True, max_bytes={max_bytes})
    print("RESULT", json.dumps({{"bytes": stats.bytes, "tensors": stats.tensors,
                                "logprobs": prompt_logprobs(llm, tok)}}))
"""


def test_refit_in_bounded_pieces_is_the_same_with_the_engine_core_anywhere(smollm_dir):
    """A refit in many small pieces (a 1 MiB bound: one attention or MLP block, or one
    tensor, a piece) gives the engine a one-piece refit gives, bit for bit, with the
    engine core in this process and in its own (vLLM's default on GPUs, reached only
    through ``collective_rpc``, where no message may exceed msgpack's 4 GiB)."""
    from pathlib import Path

    results = {}
    for multi, max_bytes in (("0", None), ("0", 1 << 20), ("1", 1 << 20)):
        env = {**__import__("os").environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multi}
        code = CHILD.format(tests=str(Path(__file__).parent), model_dir=smollm_dir,
                            max_bytes=max_bytes)
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
        results[multi, max_bytes] = json.loads(line.removeprefix("RESULT "))
    one = results["0", None]
    assert results["0", 1 << 20] == one and results["1", 1 << 20] == one
    model, _ = updated_model()
    assert one["bytes"] <= 0.5 * sum(p.numel() * 2 for p in model.parameters())


def test_plain_weights_through_vllms_own_load_and_processing_every_step(smollm_dir):
    """What verl's sync does: bf16 buckets through the model's ``load_weights``, then
    vLLM's ``process_weights_after_loading`` over the whole model, every step. The engine
    quantizes what it was given; with weights bf16 holds exactly, that is the refit's Q(W)
    bit for bit, step after step."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from fp4rl.integrations.vllm import engine_model

    spec = EngineSpec(smollm_dir, get_recipe(RECIPE), dtype=torch.bfloat16, max_model_len=256,
                      kv_cache_bytes=256 << 20)
    plain, refitted = make_llm(spec), make_llm(spec)
    for seed in (0, 1):  # two steps
        model, tok = updated_model(seed)
        with torch.no_grad():  # masters that bf16 holds exactly: both paths see the same W
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        engine = engine_model(plain)
        with torch.no_grad():
            engine.load_weights((n, p.detach().to(torch.bfloat16))
                                for n, p in model.named_parameters())
        process_weights_after_loading(engine, plain.llm_engine.model_config,
                                      torch.device("cpu"))
        plain.reset_prefix_cache()
        refit(refitted, model, packed=True)
        assert prompt_logprobs(plain, tok) == prompt_logprobs(refitted, tok), seed
    del plain, refitted
    gc.collect()


def test_an_engine_started_on_dummy_weights_takes_its_first_refit(smollm_dir):
    """verl starts its rollout engine with vLLM's ``dummy`` load format and syncs the
    weights afterwards: the fp4rl layers start on zero weights (nothing was loaded), and
    the first refit makes the engine the one a loaded engine refit alike is."""
    from vllm import LLM

    from fp4rl.integrations.vllm import method_kwargs

    model, tok = updated_model()
    spec = EngineSpec(smollm_dir, get_recipe(RECIPE), dtype=torch.bfloat16, max_model_len=256,
                      kv_cache_bytes=256 << 20)
    dummy = LLM(model=smollm_dir, dtype=torch.bfloat16, enforce_eager=True,
                max_model_len=256, kv_cache_memory_bytes=256 << 20, load_format="dummy",
                logprobs_mode="processed_logprobs", **spec.scheduling(),
                **method_kwargs(get_recipe(RECIPE)))
    refit(dummy, model, packed=True)
    got = prompt_logprobs(dummy, tok)
    del dummy
    gc.collect()
    loaded = make_llm(spec)
    refit(loaded, model, packed=True)
    assert got == prompt_logprobs(loaded, tok)
    del loaded
    gc.collect()
