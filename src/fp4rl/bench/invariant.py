"""``fp4rl bench invariant``: what on-policy to the bit costs, the batch-invariant forward
against the default one, side by side in one run.

Two models, the same weights and recipe, one with ``batch_invariant`` on, the three passes
of a GRPO step: the engine's rollout (``batch`` prompts, a prefill then one decode step per
token, greedy, EOS off), the trainer's no-grad scoring pass (the ``batch`` sequences of
prompt + response, one forward) and its update (the same forward with gradients, then the
backward), in fp32 and under bf16 autocast; and the step, their sum. Each pass holds the
weights (:func:`fp4rl.nn.hold_weights`) as the trainer and the engine do, so what a pass
derives from them (``Q(W)``, the packed panels of the fixed-order GEMM) is made once in it.
Every candidate is interleaved inside each repeat.
"""

from __future__ import annotations

import copy
import itertools
from statistics import median

import torch
from rich.console import Console
from rich.table import Table

from fp4rl.analysis.prompts import BUILTIN_PROMPTS, encode_prompts
from fp4rl.bench.common import Comparison, Timing, compare, measure
from fp4rl.nn import get_recipe, hold_weights, quantize_model, rollout_mode, train_mode
from fp4rl.rollout.batch import SamplingConfig
from fp4rl.rollout.kv_cache import generate
from fp4rl.rollout.logprobs import response_logprobs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: a GRPO step's passes, in the order a step runs them
KINDS = ("rollout", "score", "update")
#: what the table does not cover (docs/training.md)
GPU_EXPECTATION = ("GPU (the Triton GEMM fp4rl::bi_mm): not timed here; "
                   "benchmarks/gpu_check.py --only invariant times it on a GPU")


def run(model_name: str, recipe: str = "hif4", batch: int = 8, new_tokens: int = 32,
        repeats: int = 3, computes: tuple[str, ...] = tuple(DTYPES)
        ) -> tuple[list[Comparison], int]:
    """The ratios (batch-invariant over default) of each pass and of the step in each of
    ``computes`` (``fp32``, ``bf16``), and the scoring pass's tokens."""
    from fp4rl.models import load_model

    model, tok = load_model(model_name)
    model.eval()
    default = quantize_model(model, get_recipe(recipe))
    invariant = quantize_model(copy.deepcopy(model), get_recipe(recipe), batch_invariant=True)
    encoded = [p.reshape(-1).tolist() for p in encode_prompts(tok, BUILTIN_PROMPTS)]
    prompts = list(itertools.islice(itertools.cycle(encoded), batch))
    sampling = SamplingConfig(max_new_tokens=new_tokens, greedy=True)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    with torch.no_grad(), rollout_mode(default):
        sample = generate(default, prompts, sampling, pad_token_id=pad, eos_token_ids=[-1])
    ids, attention = sample.sequences()
    width = sample.prompt_ids.shape[1]

    def score(net: torch.nn.Module, dtype: torch.dtype) -> None:
        with torch.no_grad(), train_mode(net), hold_weights(net), _autocast(dtype):
            response_logprobs(net, ids, attention, width)

    def update(net: torch.nn.Module, dtype: torch.dtype) -> None:
        with train_mode(net), hold_weights(net):
            with _autocast(dtype):
                logp, _ = response_logprobs(net, ids, attention, width)
            (-logp.mean()).backward()
        net.zero_grad(set_to_none=True)

    def rollout(net: torch.nn.Module, dtype: torch.dtype) -> None:
        with torch.no_grad(), rollout_mode(net), _autocast(dtype):
            generate(net, prompts, sampling, pad_token_id=pad, eos_token_ids=[-1])

    fns = {}
    for label in computes:
        dtype = DTYPES[label]
        for kind, fn in zip(KINDS, (rollout, score, update), strict=True):
            fns[f"{kind}.{label}.default"] = (lambda f=fn, d=dtype: f(default, d))
            fns[f"{kind}.{label}.invariant"] = (lambda f=fn, d=dtype: f(invariant, d))
    timings = measure(fns, repeats)
    for label in computes:  # a step: its three passes, repeat by repeat
        for side in ("default", "invariant"):
            step = timings[f"step.{label}.{side}"] = Timing(f"step.{label}.{side}")
            step.times = [sum(times) for times in zip(*(timings[f"{kind}.{label}.{side}"].times
                                                        for kind in KINDS), strict=True)]
    return [compare(f"invariant.{kind}.{label}", timings, f"{kind}.{label}.invariant",
                    f"{kind}.{label}.default") for kind in (*KINDS, "step")
            for label in computes], int(attention.sum())


def _autocast(dtype: torch.dtype) -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def render(results: list[Comparison], console: Console, recipe: str, batch: int,
           new_tokens: int, tokens: int) -> None:
    table = Table(title=f"batch-invariant forward against the default ({recipe}; rollout: "
                        f"{batch} prompts x {new_tokens} new tokens; scoring and update: "
                        f"{batch} sequences, {tokens} tokens; step: the three; median s)")
    for col in ("pass", "compute", "default", "batch-invariant", "ratio"):
        table.add_column(col, justify="right")
    for r in results:
        _, kind, label = r.name.split(".")
        table.add_row(kind, label, f"{median(r.baseline_times):.3f}",
                      f"{median(r.candidate_times):.3f}", r.shown())
    console.print(table)
    console.print(GPU_EXPECTATION)
