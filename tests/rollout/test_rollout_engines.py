"""The rollout-engine interface: one registry of names, the KV-cache engine behind it, and
its place below the trainer and the integrations is kept by tests/test_layering.py."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import fp4rl
from fp4rl.models import tiny_model
from fp4rl.rl.config import ConfigError, load_config
from fp4rl.rollout import (
    EngineError,
    KVCacheEngine,
    RolloutSetup,
    SamplingConfig,
    build_engine,
    engine_name,
    get_engine,
    list_engines,
    register_engine,
)

SAMPLING = SamplingConfig(temperature=0.8, top_k=20, max_new_tokens=8)


def _prompts(tok) -> list[list[int]]:
    return [tok(t)["input_ids"] for t in ["What is 2+2?", "Hi there", "Count: 1 2 3", "x y"]]


def test_one_name_per_engine():
    assert list_engines() == ["hf", "vllm"]
    assert engine_name("hf") == "hf" and get_engine("hf") is KVCacheEngine
    with pytest.raises(EngineError, match=r"unknown rollout engine 'fp4rl'"):
        get_engine("fp4rl")  # the package's name is not an engine's
    with pytest.raises(EngineError, match=r"unknown rollout engine 'vlm' \(did you mean "
                                          r"'vllm'\?\); choose one of: hf, vllm"):
        engine_name("vlm")


def test_an_engine_of_ones_own_registers_once(monkeypatch):
    @register_engine
    class Echo(KVCacheEngine):
        name = "echo"

    assert get_engine("echo") is Echo and list_engines()[-1] == "echo"
    assert load_config("smoke", ["rollout.engine=echo"]).rollout.engine == "echo"
    register_engine(Echo)  # the same class again: nothing to refuse
    with pytest.raises(EngineError, match=r"rollout engine 'hf' is already registered"):
        register_engine(type("Other", (KVCacheEngine,), {"name": "hf"}))
    with pytest.raises(EngineError, match=r"needs a name of its own, got ''"):
        register_engine(type("Nameless", (KVCacheEngine,), {"name": ""}))


def test_the_config_refuses_a_name_no_engine_has_in_one_line():
    with pytest.raises(ConfigError, match=r"unknown rollout engine 'fp4rl'.*choose one of: "
                                          r"hf, vllm") as refused:
        load_config("smoke", ["rollout.engine=fp4rl"])
    assert "\n" not in str(refused.value)


def _greedy_without_cache(model, prompt: list[int], steps: int, eos: int
                          ) -> tuple[list[int], list[float]]:
    """Greedy decoding the slow way: the whole sequence through the model at each step,
    no KV cache, no padding, one prompt at a time; the chosen token's log-prob in fp32."""
    ids, logps = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logps.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
            if token == eos:
                break
    return ids[len(prompt):], logps


@pytest.mark.parametrize("recipe", [None, "hif4+resq-2:4"])
def test_the_kv_cache_engine_decodes_as_the_model_does_without_a_cache(recipe):
    """Greedy responses of left-padded chunks with a KV cache are the tokens the model
    picks one full forward at a time (the rollout policy for a patched model), and their
    log-probs that forward's."""
    torch.manual_seed(0)
    model, tok = tiny_model("llama", initializer_range=0.2)
    if recipe:
        fp4rl.quantize_model(model, recipe)
    prompts = _prompts(tok)
    greedy = SamplingConfig(greedy=True, max_new_tokens=8)
    engine = KVCacheEngine(model, tok.pad_token_id, [tok.eos_token_id], compute_dtype=torch.float32)
    got = engine.generate([prompts[:3], prompts[3:]], [[11, 12, 13], [14]], greedy)
    rows = [(b, r) for b in got for r in range(b.response_ids.shape[0])]
    with fp4rl.rollout_mode(model) if recipe else contextlib.nullcontext():
        for prompt, (batch, r) in zip(prompts, rows, strict=True):
            n = int(batch.response_mask[r].sum())
            tokens, logps = _greedy_without_cache(model, prompt, 8, tok.eos_token_id)
            assert batch.response_ids[r, :n].tolist() == tokens
            assert batch.logprobs[r, :n].tolist() == pytest.approx(logps, abs=1e-4)


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
    recipe = fp4rl.nn.get_recipe("hif4")
    fp4rl.quantize_model(model, recipe)
    setup = RolloutSetup(model="tiny", policy=model, recipe=recipe, compute_dtype=torch.float32,
                         seed=0, max_model_len=64, pad_token_id=tok.pad_token_id,
                         eos_token_ids=(tok.eos_token_id,))
    engine = build_engine("hf", setup)
    assert isinstance(engine, KVCacheEngine) and engine.policy is model
    assert engine.sync(model) == {}  # the trainer's own module is always current


def test_a_setup_hands_an_engine_its_own_settings_typed():
    from pydantic import BaseModel

    class Mine(BaseModel):
        depth: int = 3

    class Theirs(BaseModel):
        width: int = 1

    model, tok = tiny_model("llama")
    setup = RolloutSetup(model="tiny", policy=model, recipe=fp4rl.nn.get_recipe("bf16"),
                         compute_dtype=torch.float32, seed=0, max_model_len=64,
                         pad_token_id=tok.pad_token_id, eos_token_ids=(1,))
    assert setup.settings_as(Mine) == Mine()  # none given: the model's defaults
    setup = dataclasses.replace(setup, settings=Mine(depth=5))
    assert setup.settings_as(Mine).depth == 5
    with pytest.raises(TypeError, match="Theirs settings expected, got Mine"):
        setup.settings_as(Theirs)

