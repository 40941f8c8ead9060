"""The rollout-engine interface: one registry of names, the KV-cache engine behind it, and
its place below the trainer and the integrations is kept by tests/test_layering.py."""

from __future__ import annotations

import pytest
import torch

import fp4rl
from fp4rl.models import tiny_model
from fp4rl.rl.config import load_config
from fp4rl.rollout import (
    EngineError,
    KVCacheEngine,
    RolloutSetup,
    SamplingConfig,
    build_engine,
    engine_name,
    generate,
    get_engine,
    list_engines,
    register_engine,
    row_generators,
)

SAMPLING = SamplingConfig(temperature=0.8, top_k=20, max_new_tokens=8)


def _prompts(tok) -> list[list[int]]:
    return [tok(t)["input_ids"] for t in ["What is 2+2?", "Hi there", "Count: 1 2 3", "x y"]]


def test_one_name_per_engine_and_the_alias():
    assert list_engines() == ["hf", "vllm"]
    assert engine_name("fp4rl") == "hf" and get_engine("fp4rl") is KVCacheEngine
    with pytest.raises(EngineError, match=r"unknown rollout engine 'vlm' \(did you mean "
                                          r"'vllm'\?\); choose one of: hf, vllm"):
        engine_name("vlm")


def test_an_engine_of_ones_own_registers_once(monkeypatch):
    @register_engine
    class Echo(KVCacheEngine):
        name = "echo"

    assert get_engine("echo") is Echo and list_engines()[-1] == "echo"
    assert load_config("smoke", ["rollout.engine=echo"]).rollout_engine == "echo"
    register_engine(Echo)  # the same class again: nothing to refuse
    with pytest.raises(EngineError, match=r"rollout engine 'hf' is already registered"):
        register_engine(type("Other", (KVCacheEngine,), {"name": "hf"}))
    with pytest.raises(EngineError, match=r"needs a name of its own, got 'fp4rl'"):
        register_engine(type("Alias", (KVCacheEngine,), {"name": "fp4rl"}))


def test_the_config_reads_the_alias_as_the_engine():
    assert load_config("smoke", ["rollout.engine=fp4rl"]).rollout_engine == "hf"


@pytest.mark.parametrize("recipe", [None, "hif4+resq-2:4"])
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_the_kv_cache_engine_is_the_generate_function_per_chunk(recipe, precision):
    """Each chunk is one micro-batch of :func:`generate`, its rows seeded one by one, under
    the run's autocast and (for a patched model) in rollout mode: bit for bit."""
    torch.manual_seed(0)
    model, tok = tiny_model("llama", initializer_range=0.2)
    if recipe:
        fp4rl.quantize_model(model, recipe)
    prompts = _prompts(tok)
    chunks, seeds = [prompts[:3], prompts[3:]], [[11, 12, 13], [14]]
    engine = KVCacheEngine(model, tok.pad_token_id, [tok.eos_token_id],
                           mixed_precision=precision)
    got = engine.generate(chunks, seeds, SAMPLING)
    mode = fp4rl.rollout_mode(model) if recipe else torch.no_grad()
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"), mode:
        want = [generate(model, c, SAMPLING, pad_token_id=tok.pad_token_id,
                         eos_token_ids=[tok.eos_token_id], generator=row_generators(s))
                for c, s in zip(chunks, seeds, strict=True)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.response_ids, w.response_ids)
        assert torch.equal(g.logprobs, w.logprobs)


def test_a_rows_seed_decides_its_draw():
    model, tok = tiny_model("llama", initializer_range=0.2)
    engine = KVCacheEngine(model, tok.pad_token_id, [])
    prompt = _prompts(tok)[0]
    same = engine.generate([[prompt, prompt]], [[5, 5]], SAMPLING)[0].response_ids
    other = engine.generate([[prompt]], [[6]], SAMPLING)[0].response_ids
    assert torch.equal(same[0], same[1]) and not torch.equal(same[0], other[0])
    with pytest.raises(ValueError, match=r"chunks of \[2\] prompts got seeds for \[1\]"):
        engine.generate([[prompt, prompt]], [[5]], SAMPLING)


def test_the_registry_builds_the_kv_cache_engine_from_a_setup():
    model, tok = tiny_model("llama")
    recipe = fp4rl.nn.preset("hif4")
    fp4rl.quantize_model(model, recipe)
    setup = RolloutSetup(model="tiny", policy=model, recipe=recipe, mixed_precision="no",
                         seed=0, max_model_len=64, pad_token_id=tok.pad_token_id,
                         eos_token_ids=(tok.eos_token_id,))
    engine = build_engine("hf", setup)
    assert isinstance(engine, KVCacheEngine) and engine.policy is model
    assert engine.sync(model) == {}  # the trainer's own module is always current

