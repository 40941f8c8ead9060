"""The slow path every rollout engine is held to (tests/rollout/test_engine_distribution.py,
tests/vllm_engine/test_engine_distribution_vllm.py): one full forward of the rollout
policy over a prompt (and a completion), no KV cache, no padding, one sequence at a time,
and the filtered distribution it gives (temperature, then top-k)."""

from __future__ import annotations

import torch

from fp4rl.models import tiny_model

TOP_K, TEMPERATURE, TOKENS = 12, 0.9, 3
RECIPE = "hif4+resq-2:4"
#: prompts of different lengths, batched together (left padding) by the engines
TEXTS = ("What is 2+2?", "Count: 1 2 3 4 5 6 7 8 9 and then", "x")
#: the chi-square statistic with TOP_K - 1 = 11 degrees of freedom exceeds this with
#: probability 1e-4 under the null (the engine samples the policy's distribution)
CHI2_LIMIT = 42.1


def peaked_tiny_llama():
    """A tiny random Llama whose next-token distributions are far from uniform (larger
    initial weights), so that a wrong temperature or filter shows in the draws."""
    return tiny_model("llama", seed=3, initializer_range=0.3)


def filtered_logp(logits: torch.Tensor) -> torch.Tensor:
    """log-probs of the distribution sampled: temperature, then the top-k tokens."""
    scaled = logits.float() / TEMPERATURE
    kth = scaled.topk(TOP_K).values[-1]
    return scaled.masked_fill(scaled < kth, float("-inf")).log_softmax(-1)


def slow_logps(model, prompt: list[int], completion: list[int]) -> list[float]:
    """Each completion token's log-prob from one full forward, unpadded."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0]
    return [float(filtered_logp(logits[len(prompt) - 1 + i])[t])
            for i, t in enumerate(completion)]


def first_token_chi2(model, prompt: list[int], firsts: torch.Tensor) -> float:
    """The chi-square statistic of the first tokens an engine drew for ``prompt`` against
    the policy's exact first-token distribution; every draw must lie in its support."""
    with torch.no_grad():
        probs = filtered_logp(model(torch.tensor([prompt])).logits[0, -1]).exp()
    support = probs.nonzero().squeeze(-1)
    assert set(firsts.tolist()) <= set(support.tolist())
    counts = torch.stack([(firsts == s).sum() for s in support]).double()
    expected = probs[support].double() * len(firsts)
    return float(((counts - expected) ** 2 / expected).sum())
