"""``fp4rl bench rollout``: generation throughput, bf16 vs FP4 vs FP4 + ResQ-2:4.

The same prompts, greedy, EOS disabled so every configuration produces the same number of
tokens; the policies are interleaved inside each repeat. The baseline is the unquantized
model under bf16 autocast (what a user would otherwise run); the FP4 policies run under
the same autocast, and an fp32 row shows what bf16 itself buys on this machine. Weights
are quantized once per policy version (the rollout cache), so what remains is the
per-token activation work.
"""

from __future__ import annotations

from collections.abc import Callable
from statistics import median

import torch
from rich.console import Console
from rich.table import Table

from fp4rl.analysis.prompts import BUILTIN_PROMPTS, encode_prompts
from fp4rl.bench.common import Comparison, compare, measure
from fp4rl.nn import quantize_model, rollout_mode
from fp4rl.precision import autocast
from fp4rl.rl.rollout import SamplingConfig, generate

POLICIES = ("hif4", "hif4+resq-2:4")


def run(model_name: str = "smollm2-135m", batch: int = 8, new_tokens: int = 32,
        repeats: int = 3, device: str | torch.device = "cpu") -> tuple[list[Comparison], int]:
    """Median generation time of each policy; ratios against bf16 generation."""
    from fp4rl.models import load_model

    dev = torch.device(device)
    plain, tok = load_model(model_name, device=dev)
    patched, _ = load_model(model_name, device=dev)
    prompts = [ids[0].tolist() for ids in encode_prompts(tok, BUILTIN_PROMPTS[:batch])]
    sampling = SamplingConfig(max_new_tokens=new_tokens, greedy=True)

    def sample(model: torch.nn.Module, precision: str) -> None:
        with autocast(dev, precision):
            generate(model, prompts, sampling, pad_token_id=tok.pad_token_id,
                     eos_token_ids=[])

    def policy(name: str) -> Callable[[], None]:
        """One rollout of a new policy version: the weights are quantized once, then cached."""
        def go() -> None:
            quantize_model(patched, name)
            with rollout_mode(patched):
                sample(patched, "bf16")
        return go

    fns = {"bf16": lambda: sample(plain, "bf16"), "fp32": lambda: sample(plain, "no"),
           **{n: policy(n) for n in POLICIES}}
    timings = measure(fns, repeats)
    results = [compare(f"rollout.{name}_vs_bf16", timings, name, "bf16",
                       "<= 1.3 (hif4+resq-2:4)") for name in POLICIES]
    results.append(compare("rollout.fp32_vs_bf16", timings, "fp32", "bf16"))
    return results, len(prompts) * new_tokens


def render(results: list[Comparison], tokens: int, console: Console) -> None:
    table = Table(title=f"greedy generation, {tokens} tokens per run (median)")
    for col in ("policy", "seconds", "tokens/s", "time vs bf16"):
        table.add_column(col, justify="right")
    base = median(results[0].baseline_times)
    table.add_row("unquantized, bf16 compute", f"{base:.2f}", f"{tokens / base:.1f}", "1.00x")
    for r in results:
        t = median(r.candidate_times)
        label = "unquantized, fp32 compute" if r.candidate == "fp32" else f"{r.candidate}, bf16"
        table.add_row(label, f"{t:.2f}", f"{tokens / t:.1f}", f"{r.ratio:.2f}x")
    console.print(table)
