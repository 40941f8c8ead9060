"""``fp4rl bench rollout``: generation throughput, bf16 vs FP4 vs FP4 + ResQ-2:4, in fp4rl's
own engine (``hf``: the Hugging Face model with fp4rl's patched linears) and in vLLM with
the fp4rl plug-in (``vllm``).

The same prompts (the built-in ones, cycled up to the batch, encoded once, fed to vLLM as
token ids), greedy, EOS disabled so every configuration produces the same number of tokens;
every policy of every engine is interleaved inside each repeat, after all of them were
built. Each engine is driven through :mod:`fp4rl.rollout`'s interface, by the same
``generate`` call the trainer makes (per-row seeds, the sampled tokens' log-probs).
In ``hf`` the baseline is the unquantized model in the run's compute dtype (bf16 autocast
where the device has bf16 natively: what a user would otherwise run; fp32 on a CPU that
would emulate bf16, as ``mixed_precision: auto`` resolves there); the FP4 policies run in
the same dtype, and under bf16 an fp32 row shows what bf16 itself buys on this machine.
Weights are quantized once per policy version (the rollout cache), so what remains is the
per-token activation work. In ``vllm`` the baseline is plain vLLM in the same dtype and
each FP4 policy is one engine with the fp4rl method
(``Q(W)`` computed at load, ``Q(X)`` per call); the prefix cache is cleared before each
timed call, as after a refit, so no repeat reuses an earlier one's prefill.

With both engines, ``rollout.hf.hif4+resq-2:4_vs_vllm.hif4+resq-2:4`` is fp4rl's time over
vLLM's for the same tokens: vLLM's tokens/s over fp4rl's. On a CPU, vLLM binds the
process's OpenMP threads when it starts, so both engines then run on the same threads
(``machine.threads`` in the JSON; set ``OMP_NUM_THREADS`` to choose them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, TypedDict

import torch
from rich.console import Console
from rich.table import Table

from fp4rl.analysis.prompts import BUILTIN_PROMPTS, encode_prompts
from fp4rl.bench.common import Comparison, compare, measure
from fp4rl.nn import quantize_model
from fp4rl.precision import compute_dtype
from fp4rl.rollout import (
    KVCacheEngine,
    RolloutEngine,
    SamplingConfig,
    engine_name,
    list_engines,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BENCH_RECIPES = ("hif4", "hif4+resq-2:4")
#: the policy whose targets the rows state, and the one the two engines are compared on
RESQ = "hif4+resq-2:4"
TARGET = f"<= 1.3 ({RESQ})"
CROSS_TARGET = ">= 2 (vLLM tokens/s over hf's)"


def check_engines(engines: Sequence[str]) -> tuple[str, ...]:
    """The engines asked for (aliases read as their engine), in the registry's order;
    an unknown name, or vLLM's absence, is one line."""
    names = {engine_name(e) for e in engines or ["(none)"]}
    if "vllm" in names:
        from fp4rl.rollout.vllm.errors import require_vllm

        require_vllm()
    return tuple(e for e in list_engines() if e in names)


def default_batch(engines: Sequence[str]) -> int:
    """Prompts per run: 8 for fp4rl's engine alone, 32 when vLLM is measured (a batch
    where its scheduler and kernels show)."""
    return 32 if "vllm" in engines else 8


#: the compute dtype's name in the rows, by ``mixed_precision`` value
COMPUTE = {"bf16": "bf16", "no": "fp32"}


def run(model_name: str = "smollm2-135m", batch: int | None = None, new_tokens: int = 32,
        repeats: int = 3, device: str | torch.device = "cpu",
        engines: Sequence[str] = ("hf",), mixed_precision: str = "bf16"
        ) -> tuple[list[Comparison], int]:
    """Median generation time of each policy in each engine; ratios against the same
    engine's unquantized generation in the same compute dtype (``mixed_precision``:
    ``bf16`` or ``no``, resolved; and, with both engines, hf's ResQ time over vLLM's)."""
    engines = check_engines(engines)
    label = COMPUTE[mixed_precision]
    batch = batch or default_batch(engines)
    dev = torch.device(device)
    fns: dict[str, Callable[[], None]] = {}
    hf_fns = None
    if "hf" in engines:
        hf_fns, tok = _hf(model_name, dev, mixed_precision)
    else:
        from transformers import AutoTokenizer

        from fp4rl.rollout.vllm.engine import model_dir

        tok = AutoTokenizer.from_pretrained(model_dir(model_name))
    texts = [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(batch)]
    prompts = [ids[0].tolist() for ids in encode_prompts(tok, texts)]
    if hf_fns is not None:
        fns.update(hf_fns(prompts, new_tokens))
    if "vllm" in engines:
        fns.update(_vllm(model_name, prompts, tok.pad_token_id, new_tokens, mixed_precision))
    timings = measure(fns, repeats)
    results = []
    for engine in engines:
        results += [compare(f"rollout.{engine}.{p}_vs_{engine}.{label}", timings,
                            f"{engine}.{p}", f"{engine}.{label}", TARGET) for p in BENCH_RECIPES]
        if engine == "hf" and label == "bf16":
            results.append(compare("rollout.hf.fp32_vs_hf.bf16", timings, "hf.fp32", "hf.bf16"))
    if len(engines) == 2:
        results.append(compare(f"rollout.hf.{RESQ}_vs_vllm.{RESQ}", timings, f"hf.{RESQ}",
                               f"vllm.{RESQ}", CROSS_TARGET))
    return results, len(prompts) * new_tokens


#: the callables to time, by name, made from the prompts (token ids) and tokens per prompt
_Timed = Callable[[list[list[int]], int], dict[str, Callable[[], None]]]


def _hf(model_name: str, dev: torch.device, mixed_precision: str
        ) -> tuple[_Timed, PreTrainedTokenizerBase]:
    """fp4rl's engine: the callables to time (given the prompts), and the tokenizer; the
    policies in ``mixed_precision``'s compute dtype, and fp32 beside bf16."""
    from fp4rl.models import load_model

    plain, tok = load_model(model_name, device=dev)
    patched, _ = load_model(model_name, device=dev)

    def fns(prompts: list[list[int]], new_tokens: int) -> dict[str, Callable[[], None]]:
        sampling = SamplingConfig(max_new_tokens=new_tokens, greedy=True)

        def sample(engine: RolloutEngine) -> None:
            engine.generate([prompts], [list(range(len(prompts)))], sampling)

        def engine(model: torch.nn.Module, precision: str) -> KVCacheEngine:
            return KVCacheEngine(model, tok.pad_token_id, [],
                                 compute_dtype=compute_dtype(precision))

        def policy(name: str) -> Callable[[], None]:
            """One rollout of a new policy version: weights quantized once, then cached."""
            def go() -> None:
                quantize_model(patched, name)
                sample(engine(patched, mixed_precision))
            return go

        plains = {"hf.bf16": lambda: sample(engine(plain, "bf16"))} \
            if mixed_precision == "bf16" else {}
        return {**plains, "hf.fp32": lambda: sample(engine(plain, "no")),
                **{f"hf.{n}": policy(n) for n in BENCH_RECIPES}}

    return fns, tok


class _EngineSizes(TypedDict):
    """The sizes every vLLM engine of a run is built with (:class:`EngineSpec` keywords)."""

    max_model_len: int
    kv_cache_bytes: int


def _vllm(model_name: str, prompts: list[list[int]], pad_token_id: int,
          new_tokens: int, mixed_precision: str) -> dict[str, Callable[[], None]]:
    """vLLM: one engine per policy (plain vLLM the baseline), all in ``mixed_precision``'s
    compute dtype, all built before any is timed."""
    from fp4rl.nn.recipe import get_recipe
    from fp4rl.rollout.vllm.engine import EngineSpec, VLLMEngine, model_dir

    directory = model_dir(model_name)
    longest = max(map(len, prompts)) + new_tokens
    sizes: _EngineSizes = {"max_model_len": max(longest, 256),
                           "kv_cache_bytes": _kv_cache_bytes(directory, len(prompts) * longest)}
    label, dtype = COMPUTE[mixed_precision], compute_dtype(mixed_precision)
    specs = {label: EngineSpec(directory, None, dtype=dtype, **sizes),
             **{p: EngineSpec(directory, get_recipe(p), dtype=dtype, **sizes)
                for p in BENCH_RECIPES}}
    engines = {name: VLLMEngine.from_spec(spec, pad_token_id, []) for name, spec in specs.items()}
    sampling = SamplingConfig(max_new_tokens=new_tokens, greedy=True)

    def rollout(engine: VLLMEngine) -> Callable[[], None]:
        def go() -> None:
            engine.llm.reset_prefix_cache()
            engine.generate([prompts], [list(range(len(prompts)))], sampling)
        return go

    return {f"vllm.{name}": rollout(engine) for name, engine in engines.items()}


def _kv_cache_bytes(directory: str, tokens: int) -> int:
    """KV-cache memory for ``tokens`` tokens of bf16 keys and values, doubled, at least
    64 MiB: three engines in one process each hold one."""
    config = json.loads((Path(directory) / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * 2 * heads * head_dim * 2
    return max(64 << 20, 2 * tokens * per_token)


def render(results: list[Comparison], tokens: int, console: Console) -> None:
    """One row per engine's baseline and policy; the compute dtype is read from the
    baseline's name (``hf.bf16``, ``vllm.fp32``)."""
    base_label = next((r.baseline.partition(".")[2] for r in results
                       if r.target != CROSS_TARGET), "bf16")
    table = Table(title=f"greedy generation, {tokens} tokens per run (median)")
    for col in ("engine", "policy", "seconds", "tokens/s", f"time vs {base_label}"):
        table.add_column(col, justify="right")
    cross = None
    shown: set[str] = set()
    for r in results:
        if r.target == CROSS_TARGET:
            cross = r
            continue
        engine, _, policy = r.candidate.partition(".")
        compute = r.baseline.partition(".")[2]
        if r.baseline not in shown:
            shown.add(r.baseline)
            base = median(r.baseline_times)
            table.add_row(engine, f"unquantized, {compute} compute", f"{base:.2f}",
                          f"{tokens / base:.1f}", "1.00x")
        t = median(r.candidate_times)
        name = f"unquantized, {policy} compute" if policy in COMPUTE.values() \
            else f"{policy}, {compute}"
        table.add_row(engine, name, f"{t:.2f}", f"{tokens / t:.1f}", r.shown())
    console.print(table)
    if cross is not None:
        console.print(f"vLLM {RESQ} tokens/s over hf {RESQ} tokens/s: {cross.ratio:.2f}x "
                      "(target >= 2)", markup=False, highlight=False)
