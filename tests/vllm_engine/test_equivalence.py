"""fp4rl's rollout policy inside vLLM equals fp4rl's own rollout mode.

The independent path is fp4rl's patched Hugging Face model in rollout mode (its KV-cache
engine's forward). Layer by layer the two must agree bit for bit, in bf16 and in fp32
compute: both run fp4rl's quantizers and GEMM on the same operands. Whole models differ
only where vLLM's own kernels (attention, norms) round differently from transformers'; the
tolerance for that is derived in :func:`noise_floor`.
"""

from __future__ import annotations

import gc

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from _jitter import attention_jitter  # noqa: E402

import fp4rl  # noqa: E402
from fp4rl.integrations.vllm import EngineSpec, engine_model, make_llm, refit  # noqa: E402
from fp4rl.models import load_model  # noqa: E402
from fp4rl.nn.recipe import get_recipe  # noqa: E402

RECIPES = ("hif4", "mxfp4", "nvfp4", "nvfp4_per_token+resq-2:4", "hif4+resq-2:4", "mxfp4+resq-2:4")
#: vLLM linear -> the Hugging Face linears it holds, in row order
KINDS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}


@pytest.fixture(scope="module")
def hf():
    model, tok = load_model("smollm2-135m")
    return model, tok


def engine(smollm_dir: str, recipe: str, dtype: torch.dtype, model=None):
    """An engine for ``recipe``; given fp4rl's patched ``model``, refit from it (as the
    trainer does before every rollout), so that it holds the Q(W) of the FP32 masters."""
    llm = make_llm(EngineSpec(smollm_dir, get_recipe(recipe), dtype=dtype, max_model_len=256,
                              kv_cache_bytes=256 << 20))
    if model is not None:
        refit(llm, model)
    return llm


def release(llm) -> None:
    del llm
    gc.collect()


def activations(rows: int, width: int, seed: int) -> torch.Tensor:
    """Inputs with a few outlier channels, as the model's down_proj inputs have (so ResQ's
    residual and NVFP4's per-tensor scale both matter)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    x[:, torch.randperm(width, generator=g)[:4]] *= 300.0
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_linear_kind_equals_fp4rl_bit_for_bit(smollm_dir, hf, recipe, dtype):
    model, _ = hf
    fp4rl.quantize_model(model, recipe)
    llm = engine(smollm_dir, recipe, dtype, model)
    vm = dict(engine_model(llm).named_modules())
    hm = dict(model.named_modules())
    for layer in (0, 17):
        for kind, parts in KINDS.items():
            v = vm[f"model.layers.{layer}.{kind}"]
            assert v.weight.numel() == 0  # no weight kept beside Q(W)
            x = activations(7, v.fp4rl.in_features, seed=layer).to(dtype)
            got = v.quant_method.apply(v, x)
            with torch.no_grad(), fp4rl.rollout_mode(model), \
                    torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                want = torch.cat([hm[f"model.layers.{layer}.{p}"](x.float()) for p in parts], -1)
            assert got.dtype == want.dtype == dtype
            assert torch.equal(got, want), f"{recipe} {kind} layer {layer}"
    release(llm)


PROMPTS = [f"Question: what is {a} + {b}? Answer:" for a, b in
           [(3, 7), (12, 30), (5, 9), (41, 8), (2, 2), (17, 25), (6, 60), (33, 14)]]


def hf_prefill_and_decode(model, ids: list[int], token: int, dtype: torch.dtype,
                          perturb: float = 0.0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp4rl's rollout-mode log-probs for every prompt position (one prefill) and for one
    KV-cache decode step of ``token``, as fp4rl's engine computes them. ``perturb`` > 0
    multiplies every attention output (o_proj's input) by ``1 + perturb * (+-1)``: a change
    of the size by which two correct attention kernels differ."""
    with torch.no_grad(), fp4rl.rollout_mode(model), attention_jitter(model, perturb, seed), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = model(torch.tensor([ids]), use_cache=True)
        step = model(torch.tensor([[token]]), past_key_values=out.past_key_values)
    return (torch.log_softmax(out.logits[0].float(), -1),
            torch.log_softmax(step.logits[0, -1].float(), -1))


def discrepancy(top: list[dict], ref: torch.Tensor) -> torch.Tensor:
    """Per position, the largest |log-prob difference| over vLLM's top-20 tokens."""
    return torch.tensor([max(abs(lp.logprob - ref[i, t].item()) for t, lp in d.items())
                         for i, d in enumerate(top)])


def spread(top: list[dict], ref: torch.Tensor, alt: torch.Tensor) -> torch.Tensor:
    """:func:`discrepancy` between two fp4rl forwards, over the same tokens."""
    return torch.tensor([max(abs(alt[i, t].item() - ref[i, t].item()) for t in d)
                         for i, d in enumerate(top)])


#: the attention outputs of two correct fp32 kernels differ by about an ulp (vLLM's and
#: transformers' did by up to 6e-8 here); the tolerance is what 4 ulps do to fp4rl itself
JITTER = 4 * 2.0 ** -23


def whole_model_gaps(llm, model, tok, draws: int = 3) -> tuple[float, float]:
    """Mean over every prompt position and one decode step of :func:`discrepancy` between
    the engine and fp4rl's rollout mode, and the noise floor: the largest mean spread of
    fp4rl's own log-probs when its attention outputs are jittered by :data:`JITTER`."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=20,
                            prompt_logprobs=20)
    gaps, noise = [], [[] for _ in range(draws)]
    for text in PROMPTS:
        ids = tok(text)["input_ids"]
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        first = out.outputs[0].token_ids[0]
        top = [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]

        def logprobs(ids=ids, first=first, **jitter) -> torch.Tensor:
            pre, dec = hf_prefill_and_decode(model, ids, first, torch.float32, **jitter)
            return torch.cat([pre, dec[None]])

        ref = logprobs()
        gaps.append(discrepancy(top, ref))
        for s in range(draws):
            noise[s].append(spread(top, ref, logprobs(perturb=JITTER, seed=s)))
    return torch.cat(gaps).mean().item(), max((torch.cat(n).mean().item() for n in noise),
                                              default=0.0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_prefill_and_decode_log_probs_match_fp4rl_within_its_own_noise(smollm_dir, hf, recipe):
    """fp32 compute: every prompt position (one prefill) and one decode step."""
    model, tok = hf
    fp4rl.quantize_model(model, recipe)
    llm = engine(smollm_dir, recipe, torch.float32)
    gap, floor = whole_model_gaps(llm, model, tok)
    print(f"{recipe}: vLLM vs fp4rl {gap:.4f} nats, fp4rl's own 4-ulp noise {floor:.4f}")
    assert gap <= floor
    release(llm)


@pytest.mark.parametrize("engine_recipe, other", [("hif4", "mxfp4"),
                                                  ("hif4+resq-2:4", "hif4+resq-dense")])
def test_the_comparison_tells_another_policy_apart(smollm_dir, hf, engine_recipe, other):
    """The check above fails where vLLM runs a policy other than fp4rl's: another format,
    or ResQ without its 2:4 sparsity."""
    model, tok = hf
    fp4rl.quantize_model(model, engine_recipe)
    llm = engine(smollm_dir, engine_recipe, torch.float32)
    _, floor = whole_model_gaps(llm, model, tok)
    fp4rl.quantize_model(model, other)
    gap, _ = whole_model_gaps(llm, model, tok, draws=0)
    assert gap > floor
    release(llm)


def greedy_agreement(smollm_dir, model, tok, recipe: str, dtype: torch.dtype
                     ) -> tuple[float, float]:
    """Share of 32 prompts whose 16-token greedy completion is the same in vLLM and in
    fp4rl's engine, and the same share between fp4rl's engine and itself with its
    attention outputs jittered by 4 ulps of ``dtype`` (the noise floor of the comparison)."""
    from vllm import SamplingParams, TokensPrompt

    from fp4rl.analysis.prompts import BUILTIN_PROMPTS, encode_prompts
    from fp4rl.rollout import SamplingConfig, generate

    texts = [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] + ("" if i < len(BUILTIN_PROMPTS)
                                                          else f" ({i})") for i in range(32)]
    prompts = [ids[0].tolist() for ids in encode_prompts(tok, texts)]
    llm = engine(smollm_dir, recipe, dtype)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    release(llm)
    ulp = 2.0 ** (-23 if dtype == torch.float32 else -8)

    def fp4rl_greedy(perturb: float = 0.0) -> list[list[int]]:
        with fp4rl.rollout_mode(model), attention_jitter(model, perturb), torch.autocast(
                "cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            batch = generate(model, prompts, SamplingConfig(max_new_tokens=16, greedy=True),
                             pad_token_id=tok.pad_token_id, eos_token_ids=[])
        return batch.response_ids.tolist()

    ref = fp4rl_greedy()
    vllm_rate = sum(list(o.outputs[0].token_ids) == r for o, r in zip(outs, ref,
                                                                      strict=True)) / 32
    self_rate = sum(a == b for a, b in zip(fp4rl_greedy(4 * ulp), ref, strict=True)) / 32
    return vllm_rate, self_rate


def test_greedy_completions_of_32_prompts_agree(smollm_dir, hf):
    """fp32 compute, where the engines differ only in their attention kernels' last bits.
    (In bf16 vLLM also keeps the residual stream and the norms in bf16, where fp4rl's model
    keeps FP32 under autocast: a difference of the policy's surroundings, not of its FP4
    linears, which the layer test above shows equal bit for bit.)"""
    model, tok = hf
    fp4rl.quantize_model(model, "hif4+resq-2:4")
    vllm_rate, self_rate = greedy_agreement(smollm_dir, model, tok, "hif4+resq-2:4",
                                            torch.float32)
    print(f"hif4+resq-2:4, fp32: vLLM = fp4rl on {vllm_rate:.0%} of 32 greedy completions; "
          f"fp4rl = fp4rl with 4-ulp attention jitter on {self_rate:.0%}")
    assert vllm_rate >= self_rate - 2 / 32  # within what fp4rl's own noise floor allows


@pytest.mark.parametrize("recipe", ["nemo-rl-nvfp4", "miles-nvfp4", "torchao-nvfp4"])
def test_the_fields_recipes_leave_the_same_layers_in_bf16_and_agree(smollm_dir, hf, recipe):
    """An ``ignore`` by kind (attention) or by position (the last 15% of the blocks, from
    vLLM's own model config) leaves the same layers unquantized in vLLM as in fp4rl's
    patched model, and a quantized layer of each still equals fp4rl's bit for bit (Four
    Over Six and 16x16-tile NVFP4 included)."""
    from fp4rl.gemm import UNQUANTIZED
    from fp4rl.nn import fp4_layers

    model, _ = hf
    fp4rl.quantize_model(model, recipe)
    patched = set(fp4_layers(model))
    llm = engine(smollm_dir, recipe, torch.bfloat16, model)
    vm = dict(engine_model(llm).named_modules())
    hm = dict(model.named_modules())
    blocks = model.config.num_hidden_layers
    for layer in range(blocks):
        for kind, parts in KINDS.items():
            v = vm[f"model.layers.{layer}.{kind}"]
            names = [f"model.layers.{layer}.{p}" for p in parts]
            quantized = v.fp4rl.fmt is not UNQUANTIZED
            assert quantized == all(n in patched for n in names), f"{recipe} {v.fp4rl.fmt} {names}"
            if quantized and layer in (0, blocks // 2):
                x = activations(5, v.fp4rl.in_features, seed=layer).to(torch.bfloat16)
                got = v.quant_method.apply(v, x)
                with torch.no_grad(), fp4rl.rollout_mode(model), \
                        torch.autocast("cpu", dtype=torch.bfloat16):
                    want = torch.cat([hm[n](x.float()) for n in names], -1)
                assert torch.equal(got, want), f"{recipe} {kind} layer {layer}"
    left = any(n not in patched for n in (f"model.layers.{blocks - 1}.mlp.down_proj",
                                          "model.layers.0.self_attn.q_proj"))
    assert left == bool(get_recipe(recipe).ignore)  # torchao's leaves none in BF16
    release(llm)
