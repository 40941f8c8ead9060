"""Refit: new weights loaded into a running engine give what a fresh engine gives."""

from __future__ import annotations

import gc

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from fp4rl.integrations.vllm import EngineSpec, make_llm, refit  # noqa: E402
from fp4rl.models import load_model  # noqa: E402

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


def test_refit_equals_a_fresh_engine_on_the_new_weights(smollm_dir, tmp_path):
    model, tok = load_model("smollm2-135m")
    spec = EngineSpec(smollm_dir, RECIPE, dtype=torch.bfloat16, max_model_len=256,
                      kv_cache_bytes=256 << 20)
    llm = make_llm(spec)
    before = prompt_logprobs(llm, tok)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an update of the size a few optimizer steps make
        for name, p in model.named_parameters():
            if "layers." in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.01 * p.abs().mean())
    stats = refit(llm, model.named_parameters())
    after = prompt_logprobs(llm, tok)
    del llm
    gc.collect()
    # the block linears' FP32 masters, every other tensor in the engine's bf16
    assert stats.bytes == sum(p.numel() * (4 if "layers." in n and n.endswith("proj.weight")
                                           else 2) for n, p in model.named_parameters())
    assert stats.tensors == len(list(model.parameters())) and stats.seconds > 0
    assert after != before  # the engine serves the new weights

    model.save_pretrained(tmp_path / "new")
    tok.save_pretrained(tmp_path / "new")
    fresh = make_llm(EngineSpec(str(tmp_path / "new"), RECIPE, dtype=torch.bfloat16,
                                max_model_len=256, kv_cache_bytes=256 << 20))
    assert prompt_logprobs(fresh, tok) == after
    del fresh
    gc.collect()
