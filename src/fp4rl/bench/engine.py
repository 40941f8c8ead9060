"""``fp4rl bench engine``: what a vLLM rollout engine holds and moves, bf16 against the
``fp4rl`` method's two weight storages.

Each engine is measured in a fresh process of its own (memory a process once took is not
reliably given back, so engines measured one after another in one process would be
charged for each other): the trainer's model is loaded, patched and read once (its
weights may be mapped from the model cache's file, and are resident in a trainer), then
the engine is built and refit once from it, as the trainer does before its first rollout.
Per engine:

- ``rss_bytes``: the process's resident memory added by building and refitting the engine
  (its weights, KV cache and workspace; the KV cache is the same size for all three);
- ``block_bytes_per_param``: bytes the block linears' weights take in the engine, per
  parameter (bf16: vLLM's prepacked copy; ``dequantized``: ``Q(W)`` as that same prepacked
  copy; ``packed``: codes and scales);
- ``refit_bytes`` and ``refit_seconds`` (median): one refit from the trainer's model, with
  ``Q(W)`` as packed codes and scales, the trainer's default (the
  bf16 row: every parameter in bf16, what TRL and verl send; vLLM's own CPU linears drop
  the weight they prepack, so a plain bf16 engine is not refit here);
- ``tokens_per_second`` (median): greedy generation of the built-in prompts.

The ratios are against the bf16 engine, the one a user would otherwise run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, TypedDict, cast

from rich.console import Console
from rich.table import Table

from fp4rl.errors import UserError

if TYPE_CHECKING:
    import torch
    from vllm import LLM

#: the engines compared: plain vLLM in bf16, and the fp4rl method in each storage
ENGINE_KINDS = ("bf16", "dequantized", "packed")
RECIPE = "hif4+resq-2:4"


class EngineFigures(TypedDict):
    """One engine's figures, as :func:`measure_engine` measures them in its process."""

    engine: str
    rss_bytes: int
    block_params: int
    block_bytes_per_param: float
    refit_bytes: int
    refit_seconds: float
    tokens_per_second: float


class EngineRow(EngineFigures):
    """One engine's figures with their ratios to the bf16 engine's (a row of :func:`run`)."""

    rss_bytes_vs_bf16: float
    block_bytes_per_param_vs_bf16: float
    refit_bytes_vs_bf16: float
    tokens_per_second_vs_bf16: float


def rss() -> int:
    """This process's resident set, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise UserError("bench engine reads /proc/self/status (Linux)")


def measure_engine(engine: str, model_name: str, batch: int, new_tokens: int,
                   repeats: int) -> EngineFigures:
    """The figures of one engine, measured in this process (run it in a fresh one)."""
    import torch

    from fp4rl.analysis.prompts import BUILTIN_PROMPTS, encode_prompts
    from fp4rl.integrations.vllm import (
        EngineSpec,
        engine_model,
        make_llm,
        model_dir,
        refit,
        require_vllm,
    )
    from fp4rl.models import load_model
    from fp4rl.nn import get_recipe, quantize_model
    from fp4rl.rollout.vllm.config import WeightStorage
    from fp4rl.rollout.vllm.loading import store_bytes
    from fp4rl.rollout.vllm.stores import release_freed_memory

    vllm = require_vllm()
    model, tok = load_model(model_name)
    recipe = None if engine == "bf16" else get_recipe(RECIPE)
    if recipe is not None:
        quantize_model(model, recipe)
    block_params = _block_params(model)
    texts = [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(batch)]
    prompts = [vllm.TokensPrompt(prompt_token_ids=ids[0].tolist())
               for ids in encode_prompts(tok, texts)]
    with torch.no_grad():  # the trainer's weights resident (they may be mapped from a file)
        for p in model.parameters():
            p.sum()
    release_freed_memory()
    before = rss()
    spec = EngineSpec(model_dir(model_name), recipe, dtype=torch.bfloat16,
                      max_model_len=512, kv_cache_bytes=256 << 20,
                      weight_storage=WeightStorage.PACKED if engine == "packed"
                      else WeightStorage.DEQUANTIZED)
    llm = make_llm(spec)
    if recipe is not None:  # packed: the trainer's default wire (rollout.vllm.refit_wire)
        refit(llm, model, packed=True)
    release_freed_memory()
    added = rss() - before
    if recipe is None:  # vLLM's own CPU linears drop the weight they prepack: no refit
        held, refit_bytes, refit_seconds = 2 * block_params, sum(
            2 * p.numel() for p in model.parameters()), float("nan")
    else:  # what TRL and verl would send instead: every parameter in bf16
        held = store_bytes(engine_model(llm))
        refits = [refit(llm, model, packed=True) for _ in range(repeats)]
        refit_bytes, refit_seconds = refits[-1].bytes, median(r.seconds for r in refits)
    return {"engine": engine, "rss_bytes": added, "block_params": block_params,
            "block_bytes_per_param": held / block_params,
            "refit_bytes": refit_bytes, "refit_seconds": refit_seconds,
            "tokens_per_second": batch * new_tokens / _generate_seconds(
                llm, prompts, new_tokens, repeats)}


def _block_params(model: torch.nn.Module) -> int:
    """The parameters of the transformer blocks' linears: the FP4 layers' where the model
    is patched, else the block projections' (the bf16 engine's model)."""
    from fp4rl.nn import fp4_layers

    return sum(m.weight.numel() for m in fp4_layers(model).values()) or sum(
        p.numel() for n, p in model.named_parameters() if ".layers." in n and
        n.endswith("proj.weight"))


def _generate_seconds(llm: LLM, prompts: list[object], new_tokens: int,
                      repeats: int) -> float:
    """The median seconds of ``repeats`` greedy generations of ``new_tokens`` tokens for
    each prompt, after one warm-up, the prefix cache reset before each."""
    import vllm

    params = vllm.SamplingParams(temperature=0, ignore_eos=True, max_tokens=new_tokens)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return median(times[1:])


def run(model_name: str = "smollm2-135m", batch: int = 8, new_tokens: int = 16,
        repeats: int = 3, engines: tuple[str, ...] = ENGINE_KINDS) -> list[EngineRow]:
    """Each engine's figures, each from a fresh process."""
    from fp4rl.integrations.vllm import require_vllm

    require_vllm()
    rows: list[EngineFigures] = []
    for engine in engines:
        code = ("import json, sys; from fp4rl.bench.engine import measure_engine; "
                f"print('RESULT', json.dumps(measure_engine({engine!r}, {model_name!r}, "
                f"{batch}, {new_tokens}, {repeats})))")
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=3600)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"bench engine: the {engine} engine failed: {tail}")
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
        # the child's measure_engine() return value, dumped as JSON
        rows.append(cast(EngineFigures, json.loads(line.removeprefix("RESULT "))))
    base = rows[0]
    return [{**r, "rss_bytes_vs_bf16": _vs(r["rss_bytes"], base["rss_bytes"]),
             "block_bytes_per_param_vs_bf16": _vs(r["block_bytes_per_param"],
                                                  base["block_bytes_per_param"]),
             "refit_bytes_vs_bf16": _vs(r["refit_bytes"], base["refit_bytes"]),
             "tokens_per_second_vs_bf16": _vs(r["tokens_per_second"], base["tokens_per_second"])}
            for r in rows]


def _vs(value: float, base: float) -> float:
    """``value`` over the bf16 engine's ``base``; NaN where the base is zero."""
    return value / base if base else float("nan")


def render(rows: list[EngineRow], console: Console) -> None:
    table = Table(title=f"vLLM rollout engines, {RECIPE} (fp4rl) against bf16")
    for col in ("engine", "process memory added", "block linears B/param",
                "refit bytes", "refit s", "tokens/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["engine"],
                      f"{r['rss_bytes'] / 2**20:.0f} MiB ({r['rss_bytes_vs_bf16']:.2f}x)",
                      f"{r['block_bytes_per_param']:.3f} "
                      f"({r['block_bytes_per_param_vs_bf16']:.2f}x)",
                      f"{r['refit_bytes'] / 2**20:.0f} MiB ({r['refit_bytes_vs_bf16']:.2f}x)",
                      f"{r['refit_seconds']:.2f}",
                      f"{r['tokens_per_second']:.1f} ({r['tokens_per_second_vs_bf16']:.2f}x)")
    console.print(table)


__all__ = ["ENGINE_KINDS", "EngineFigures", "EngineRow", "measure_engine", "render", "rss", "run"]
