"""Every rollout engine samples the distribution of the rollout policy.

The independent slow path is the policy itself: one full forward over the prompt (and
each completion), no KV cache, no padding, one sequence at a time. Its filtered
first-token distribution (temperature, top-k) is exact, so the engines' first tokens,
drawn for prompts of different lengths batched together (left padding), are held to it
by a chi-square test; every token an engine reports is held to the slow path's
log-prob of that token given the same prefix, in fp32 and under bf16 autocast (what TRL
runs by default, and where a CPU's bf16 kernels come in). Engines: fp4rl's KV-cache
engine (``hf``, the trainer's and the TRL plug-in's default) and transformers'
``generate`` (the TRL plug-in's ``transformers``); ``vllm`` is held to the same slow path
in tests/vllm_engine/test_engine_distribution_vllm.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _distribution import (
    CHI2_LIMIT,
    RECIPE,
    TEMPERATURE,
    TEXTS,
    TOKENS,
    TOP_K,
    first_token_chi2,
    peaked_tiny_llama,
    slow_logps,
)
from transformers import GenerationConfig

import fp4rl
from fp4rl.integrations.trl import sample_with_fp4rl, sample_with_transformers
from fp4rl.nn import fp4_layers
from fp4rl.rollout import SamplingConfig

DRAWS = 400


@pytest.fixture(scope="module", params=[None, RECIPE], ids=["plain", "fp4"])
def policy(request):
    """The FP4 policy runs batch-invariant (docs/training.md, "On-policy to the bit"): an
    engine's batch and padding then leave a token's bits as the slow path's one-sequence
    forward computes them, so its filtered support is the slow path's. Without it, a
    GEMM's last bits depend on the rows it computes, a 4-bit rounding can flip on them,
    and a token at the top-k boundary moves in or out (the drift
    tests/rollout/test_on_policy_bits.py measures)."""
    model, tok = peaked_tiny_llama()
    if request.param:
        fp4rl.quantize_model(model, request.param, batch_invariant=True)
    return model, tok, [tok(t)["input_ids"] for t in TEXTS]


@contextlib.contextmanager
def _rollout(model, compute: str = "fp32"):
    """The rollout policy (rollout mode for an FP4 model, the model itself otherwise) in
    ``compute``: fp32, or bf16 autocast (TRL's default, ``bf16=True``)."""
    with fp4rl.rollout_mode(model) if fp4_layers(model) else contextlib.nullcontext(), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute == "bf16"):
        yield


def _sample(engine: str, model, tok, prompts: list[list[int]]):
    rows = [p for p in prompts for _ in range(DRAWS)]
    eos = [tok.eos_token_id]
    with torch.no_grad():
        if engine == "hf":
            torch.manual_seed(0)  # the engine draws each row's seed from torch's stream
            config = SamplingConfig(temperature=TEMPERATURE, top_k=TOP_K,
                                    max_new_tokens=TOKENS)
            return rows, *sample_with_fp4rl(model, rows, config, tok.pad_token_id, eos)
        torch.manual_seed(0)
        config = GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                                  top_p=1.0, max_new_tokens=TOKENS,
                                  pad_token_id=tok.pad_token_id, eos_token_id=eos)
        return rows, *sample_with_transformers(model, rows, config, tok.pad_token_id, eos)


@pytest.mark.parametrize("compute", ["fp32", "bf16"])
@pytest.mark.parametrize("engine", ["hf", "transformers"])
def test_first_tokens_follow_the_policys_distribution(policy, engine, compute):
    model, tok, prompts = policy
    with _rollout(model, compute):
        _, tokens, _ = _sample(engine, model, tok, prompts)
        for p, prompt in enumerate(prompts):  # rows run prompt by prompt, DRAWS each
            firsts = torch.tensor([t[0] for t in tokens[p * DRAWS:(p + 1) * DRAWS]])
            chi2 = first_token_chi2(model, prompt, firsts)
            assert chi2 < CHI2_LIMIT, (engine, p, chi2)


@pytest.mark.parametrize("compute", ["fp32", "bf16"])
@pytest.mark.parametrize("engine", ["hf", "transformers"])
def test_reported_logprobs_are_the_policys_for_the_tokens_drawn(policy, engine, compute):
    """Unquantized, each reported log-prob is the slow path's to fp32 accuracy. The FP4
    policy's first tokens are too (the prompt's forward); later ones may move a little:
    with a KV cache, a shorter row's attention sums over its padded keys too, which
    changes fp32 results by about 1e-6, and a 4-bit rounding that flips on it moves a
    log-prob (seen here: 0.018 nat on average, up to 0.31, HiF4 + ResQ-2:4). A misaligned,
    unfiltered or wrongly tempered log-prob is off by about a nat on average. Under bf16
    autocast (TRL's default) the cache and the full forward round differently from the
    first token on (seen: 0.025 nat on average, at most 0.35)."""
    model, tok, prompts = policy
    exact = not fp4_layers(model) and compute == "fp32"
    diffs = []
    with _rollout(model, compute):
        rows, tokens, logps = _sample(engine, model, tok, prompts)
        for i in range(0, len(rows), 31):  # a spread of rows from every prompt
            want = slow_logps(model, rows[i], tokens[i])
            if compute == "fp32":
                assert logps[i][0] == pytest.approx(want[0], abs=2e-4), (engine, i)
            if exact:
                assert logps[i] == pytest.approx(want, abs=2e-4), (engine, i)
            diffs += [abs(a - b) for a, b in zip(logps[i], want, strict=True)]
    assert sum(diffs) / len(diffs) < 0.1, (engine, sum(diffs) / len(diffs))
