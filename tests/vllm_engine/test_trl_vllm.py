"""TRL's GRPOTrainer rolling out in vLLM with the fp4rl method: ``FP4GRPOTrainer`` with
``use_vllm=True, vllm_mode="colocate"`` on the embedded model.

TRL builds and drives the colocated engine; fp4rl selects its quantization method, refits
and re-quantizes the engine before each generation round, and TRL's own importance-sampling
correction compares vLLM's log-probs (mu) with the training policy's (pi_old)."""

from __future__ import annotations

import gc
import math

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")
pytest.importorskip("trl", reason="TRL is not installed: pip install \"trl>=1.16,<1.17\"")

from _jitter import attention_jitter  # noqa: E402
from _trl_checks import IS_METRICS, digit_fraction, logged, recomputed_logprobs  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

import fp4rl  # noqa: E402
from fp4rl.integrations.trl import FP4GRPOTrainer  # noqa: E402
from fp4rl.integrations.vllm import engine_model  # noqa: E402
from fp4rl.models import load_model  # noqa: E402

RECIPE = "hif4+resq-2:4"
PROMPTS = ["Question: what is 3 + 7? Answer:", "Question: what is 12 + 30? Answer:",
           "Question: what is 5 + 9? Answer:", "Question: what is 41 + 8? Answer:"]
#: 4 ulps of fp32 on every attention output: how far two correct attention kernels' last
#: bits move fp4rl's own log-probs (see test_equivalence)
JITTER = 4 * 2.0 ** -23


def sampled_logprobs(model, prompt: list[int], completion: list[int], temperature: float,
                     policy: str, perturb: float = 0.0, seed: int = 0) -> torch.Tensor:
    """:func:`recomputed_logprobs` under fp4rl's ``policy`` forward in fp32, its attention
    outputs jittered by ``perturb`` (nothing shared with vLLM)."""
    mode = fp4rl.rollout_mode if policy == "rollout" else fp4rl.train_mode
    with torch.no_grad(), mode(model), attention_jitter(model, perturb, seed):
        return recomputed_logprobs(model, prompt, completion, temperature, top_k=0)


def recomputed(model, prompts, completions, temperature, policy, **jitter) -> torch.Tensor:
    """Every sampled token's log-prob under fp4rl's ``policy``, concatenated."""
    return torch.cat([sampled_logprobs(model, p, c, temperature, policy, **jitter)
                      for p, c in zip(prompts, completions, strict=True)])


@pytest.mark.slow
def test_trl_rolls_out_in_vllm_as_the_fp4_rollout_policy(tmp_path):
    model, tok = load_model("smollm2-135m")
    weight = model.model.layers[0].mlp.down_proj.weight
    before = weight.detach().clone()
    args = GRPOConfig(per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      max_steps=2, use_cpu=True, bf16=False, temperature=0.7, report_to="none",
                      save_strategy="no", logging_steps=1, output_dir=str(tmp_path),
                      use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128)
    trainer = FP4GRPOTrainer(model=model, reward_funcs=digit_fraction, args=args,
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                             processing_class=tok, fp4_recipe=RECIPE)
    llm = trainer.vllm_generation.llm
    block = [m for n, m in engine_model(llm).named_modules() if n.endswith(("qkv_proj",
                                                                           "down_proj"))]
    assert block and {type(m.quant_method).__name__ for m in block} == {"FP4RLLinearMethod"}
    trainer.train()

    assert not torch.equal(weight, before)
    metrics = logged(trainer)
    assert all(math.isfinite(metrics[k]) for k in IS_METRICS), metrics
    assert metrics["sampling/sampling_logp_difference/mean"] > 0  # FP4 rollout != training
    refits = [e for e in trainer.state.log_history if "time/refit" in e]
    assert len(refits) == 2 and all(e["time/refit"] > 0 and e["sync/bytes"] > 0 for e in refits)

    # one more round refits the engine to the trained weights; its log-probs are then the
    # trained rollout policy's, within the noise floor, and not the training policy's
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    completions, logprobs = trainer._generate_single_turn(prompts, None, {}, 1)
    assert all(0 < len(c) == len(lp) <= 8 for c, lp in zip(completions, logprobs, strict=True))
    assert trainer._last_loaded_step == trainer.state.global_step == 2
    got = torch.tensor([x for row in logprobs for x in row])
    sampled = (model, prompts, completions, args.temperature)
    ref = recomputed(*sampled, "rollout")
    rollout = (got - ref).abs().mean().item()
    floor = max((recomputed(*sampled, "rollout", perturb=JITTER, seed=s) - ref).abs().mean()
                .item() for s in range(3))
    train = (got - recomputed(*sampled, "train")).abs().mean().item()
    print(f"vLLM log-probs vs fp4rl's rollout policy {rollout:.4f} nats (its own 4-ulp "
          f"noise {floor:.4f}), vs its training policy {train:.4f}")
    assert rollout <= floor < train
    del trainer, llm
    gc.collect()
