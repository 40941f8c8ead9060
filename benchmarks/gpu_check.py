"""Everything fp4rl checks on a GPU, in one process, with every result written down.

A GPU is lent rarely and for minutes, so the checks must run in one call and survive a
failing stage: each stage runs, is timed, and writes ``<output>/<stage>.json`` (its
results, or the error that stopped it); ``<output>/summary.json`` lists every stage with
the device's name. Every figure also goes out as it exists, one JSON object a line
(``{"stage": ..., "keys": [...], ...}``), on stdout and into ``figures.jsonl``; where the
environment variable ``OUT`` names a folder (a lent machine's, whose files come back), the
stages' records and the lines are written under ``$OUT/gpu-check`` too. The stages:

1. ``tests``: the CUDA tests (every Triton operation bit-exact against the reference for
   every format, axis, dtype and token count; the rollout operations captured in CUDA
   graphs at sizes never run eagerly; a CUDA GRPO step against the CPU one), through pytest;
2. ``formats``: ``bench formats`` at 8192 x 8192, with each quantizer's GB/s (one read and
   one write of every float32 value) and its share of a clone's, the copy bandwidth;
3. ``linear``: ``bench linear`` at the Qwen2.5-3B shapes, FP4 against bf16;
4. ``rollout`` and ``train``: ``bench rollout`` and ``bench train`` on the embedded model;
5. ``vllm``: an engine per recipe with the fp4rl method (compiled, CUDA graphs on), its
   greedy log-probs against fp4rl's rollout policy (bf16 compute) before and after a refit
   (skipped where vLLM is not installed; each recipe's figures go out as they exist);
6. ``demo``: ``fp4rl demo`` on the device, its wall clock and report;
7. ``invariant``: on-policy to the bit on the device: a tiny Llama with ``batch_invariant``,
   the engine's log-probs against the trainer's for ``bf16`` and ``hif4`` (then ``mxfp4``
   and ``nvfp4_per_token`` while the stage's time allows) in fp32 and bf16, the trainer
   scoring in micro-batches of 9, 4 and 1 with 0, 5 and 32 extra left pad columns; then
   the batch-invariant forward timed against the default forward of the same model
   (a 4-layer, 2048-wide Llama, 8 x 512 tokens, bf16), and ``fp4rl::bi_mm`` against
   ``torch.mm`` at 512 x 2048 -> 11008;
8. ``speed``: each quantizer against a clone from CUDA-graph replays, the FP4 training
   linear against bf16 with one and eight micro-batches (and a profiler table), the rollout
   linear at 1-256 tokens (bf16, dequantized, packed then GEMM), beside the bytes counted
   by ``bench linear --traffic``. On a GPU run it first: ``--only speed``.

Every timed row records the dtype it computed in, read from the tensors it returned, and a
ratio whose two sides did not both compute in the dtype the row says is refused: the row
carries no ratio, and the stage ends ``error`` with one line saying which side ran in what.

``--only`` and ``--skip`` choose stages. docs/gpu.md says how to run them, with a network
or with the offline kit, and holds the runs.

``--device cpu --quick`` runs every stage at toy sizes on a CPU (``--only speed`` in
seconds), so the script is known to work before a GPU is ever lent
(``tests/bench/test_gpu_check.py``)::

    python benchmarks/gpu_check.py --output runs/gpu-check            # on the GPU machine
    python benchmarks/gpu_check.py --device cpu --quick --output /tmp/check
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from statistics import median
from typing import Any

import torch

import fp4rl.nn
from fp4rl.bench import common
from fp4rl.precision import autocast, describe_cpu

ROOT = Path(__file__).resolve().parents[1]

#: a stage's record as it is written to its JSON file
Record = dict[str, Any]


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return describe_cpu()


# --- what a timed row computed in -------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as the records write a dtype."""
    return str(dtype).removeprefix("torch.")


def computed_dtype(out: object) -> str:
    """The dtype ``out``'s floating tensors came out in (a tensor, or tensors inside
    tuples, lists and mappings such as a model's output): what the call computed in,
    whatever it was asked for. Several dtypes are joined with ``+`` (never one a row
    says); a result without a floating tensor is an error, not a guess."""
    found: set[str] = set()

    def visit(value: object) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                found.add(dtype_name(value.dtype))
        elif isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(out)
    if not found:
        raise TypeError(f"a timed call returned no floating tensor ({type(out).__name__}): "
                        "return the output it computed")
    return "+".join(sorted(found))


@dataclass(frozen=True)
class Timed:
    """One timed callable: its median seconds and the dtype of what it returned."""

    seconds: float
    dtype: str

    def row(self) -> dict[str, object]:
        return {"seconds": self.seconds, "dtype": self.dtype}


def ratio(row: str, sides: Mapping[str, Timed], candidate: str, baseline: str,
          says: torch.dtype, refused: list[str]) -> float | None:
    """``candidate``'s seconds over ``baseline``'s, where both computed in ``says``, the
    dtype the row is labelled with; otherwise None, and one line in ``refused`` saying
    which side ran in what (a ratio of two other dtypes would be reported as this one)."""
    want = dtype_name(says)
    off = [f"{name} computed in {sides[name].dtype}" for name in (candidate, baseline)
           if sides[name].dtype != want]
    if off:
        refused.append(f"{row}: no {candidate}/{baseline} ratio: {' and '.join(off)}, "
                       f"while the row says {want}")
        return None
    return sides[candidate].seconds / sides[baseline].seconds


def measure(fns: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, Timed]:
    """:func:`fp4rl.bench.common.measure` (interleaved medians), each callable's output
    dtype read from a first call."""
    dtypes = {name: computed_dtype(fn()) for name, fn in fns.items()}
    times = common.measure(fns, repeats=repeats)
    return {name: Timed(times[name].median, dtypes[name]) for name in fns}


# --- the figures as they come -----------------------------------------------------------


def _rows(value: Mapping[str, Any], keys: tuple[str, ...]
          ) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """``value`` cut into rows: its plain entries (numbers, strings, lists of numbers) as
    one row at ``keys``, each mapping inside (and each mapping of a list, by its ``name``
    or position) as rows of its own below."""
    plain: dict[str, Any] = {}
    nested: list[tuple[tuple[str, ...], Mapping[str, Any]]] = []
    for key, item in value.items():
        if isinstance(item, Mapping):
            nested.append(((*keys, str(key)), item))
        elif isinstance(item, list) and item and all(isinstance(i, Mapping) for i in item):
            nested.extend(((*keys, str(key), str(i.get("name", n))), i)
                          for n, i in enumerate(item))
        else:
            plain[str(key)] = item
    if plain or not nested:
        yield keys, plain
    for inner_keys, inner in nested:
        yield from _rows(inner, inner_keys)


class Figures:
    """Where every figure goes as it exists: one JSON object a line (``stage``, ``keys``,
    then the row's entries) on stdout and in ``figures.jsonl`` of each folder, and each
    stage's record as ``<stage>.json`` there. The folders are ``--output`` and, where the
    environment names one, ``$OUT/gpu-check``: a lent machine's run brings its numbers back
    even if it is stopped midway. The lines are appended (two runs in one job keep both),
    each run's starting with a ``run`` row."""

    def __init__(self, folders: Sequence[Path]) -> None:
        self.folders: list[Path] = []
        for folder in folders:
            if folder.resolve() not in {f.resolve() for f in self.folders}:
                folder.mkdir(parents=True, exist_ok=True)
                self.folders.append(folder)
        self.sent: set[tuple[str, tuple[str, ...]]] = set()

    def rows(self, stage: str, value: Mapping[str, Any], keys: tuple[str, ...] = ()) -> None:
        """Send ``value``'s rows (see :func:`_rows`) under ``keys``."""
        self._send(stage, _rows(value, keys))
        self.sent.add((stage, keys))

    def record(self, stage: str, record: Mapping[str, Any]) -> None:
        """Write ``record`` as ``<stage>.json`` and send its rows, less those the stage
        sent as they came (under their keys)."""
        text = json.dumps(record, indent=1, default=str)
        for folder in self.folders:
            (folder / f"{stage}.json").write_text(text)
        sent = [keys for name, keys in self.sent if name == stage and keys]
        self._send(stage, ((keys, row) for keys, row in _rows(record, ())
                           if not any(keys[:len(s)] == s for s in sent)))

    def _send(self, stage: str, rows: Iterable[tuple[tuple[str, ...], dict[str, Any]]]
              ) -> None:
        for keys, row in rows:
            line = json.dumps({"stage": stage, "keys": list(keys), **row}, default=str)
            print(line, flush=True)
            for folder in self.folders:
                with (folder / "figures.jsonl").open("a") as sink:
                    sink.write(line + "\n")


def _no_figures(stage: str, value: Mapping[str, Any], keys: tuple[str, ...] = ()) -> None:
    """Where a stage is called without a :class:`Figures` (its rows go out with its record)."""


#: how a stage sends rows before its record is written: ``(stage, value, keys)``
Send = Callable[[str, Mapping[str, Any], tuple[str, ...]], None]


# --- the stages -------------------------------------------------------------------------


def stage_tests(device: str, quick: bool) -> Record:
    # on a GPU the CUDA tests; the interpreted kernel tests prove nothing more there
    files = ["tests/kernels/test_cuda.py"] if quick or device != "cpu" else \
        ["tests/kernels/test_cuda.py", "tests/kernels/test_triton_kernels.py"]
    env = {**os.environ}
    if device == "cpu" and not quick:
        env.update(TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *files], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=3000)
    tail = done.stdout.strip().splitlines()[-1:] or ["no output"]
    return {"files": files, "exit": done.returncode, "summary": tail[0],
            "output_tail": done.stdout[-4000:]}


def stage_formats(device: str, quick: bool) -> Record:
    from fp4rl.bench import formats

    size = 256 if quick else 8192
    rows = formats.run(size=size, repeats=1 if quick else 7, reference_repeats=1,
                       device=device)
    moved = 2 * size * size * 4  # one float32 read and one write per value
    bandwidth = {}
    for r in rows:
        if r.name.endswith("fast_vs_clone"):
            fmt = r.name.split(".")[0]
            fast, clone = median(r.candidate_times), median(r.baseline_times)
            bandwidth[fmt] = {"GB/s": moved / fast / 1e9, "clone GB/s": moved / clone / 1e9,
                              "share of copy bandwidth": clone / fast}
    return {"size": size, "bandwidth": bandwidth, **common.report(rows)}


def stage_linear(device: str, quick: bool) -> Record:
    from fp4rl.bench import linear

    shapes = tuple(s for s in linear.SHAPES if s[0].startswith("qwen2.5-3b"))
    if quick:
        shapes = tuple((name, 16, d, n) for name, _, d, n in shapes[:1])
    return common.report(linear.run("hif4", shapes, repeats=1 if quick else 5,
                                    device=device))


def stage_rollout(device: str, quick: bool) -> Record:
    from fp4rl.bench import rollout

    results, tokens = rollout.run(batch=2 if quick else 8, new_tokens=4 if quick else 32,
                                  repeats=1 if quick else 3, device=device)
    return {"tokens": tokens, **common.report(results)}


def stage_train(device: str, quick: bool) -> Record:
    from fp4rl.bench import train

    changes: dict[str, object] | None = {
        "grpo.batch_size": 1, "grpo.num_generations": 2, "grpo.micro_batch_size": 2,
        "grpo.max_response_length": 4} if quick else None
    return common.report(train.run(repeats=1 if quick else 3, changes=changes,
                                   device=device))


#: the compute dtypes the invariant stage checks, by label
COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: recipes whose engine and trainer are one function (tests/rollout/test_on_policy_bits.py);
#: the first two always run, the others while the stage's budget allows
INVARIANT_RECIPES = ("bf16", "hif4", "mxfp4", "nvfp4_per_token")
#: the trainer's micro-batch sizes, and the left pad columns its batch carries beyond the
#: engine's (32: a whole block of keys of the GPU's attention GEMM)
INVARIANT_MICRO_BATCHES = (9, 4, 1)
INVARIANT_PADDINGS = (0, 5, 32)
#: seconds after which no further recipe starts, so that the stage ends within two minutes
INVARIANT_BUDGET = 75.0
PAD, EOS = 3, (2, 7, 9)


def stage_invariant(device: str, quick: bool) -> Record:
    """On-policy to the bit on ``device`` (what tests/rollout/test_on_policy_bits.py proves
    on a CPU), then what it costs: the batch-invariant forward against the default one."""
    refused: list[str] = []
    started = time.perf_counter()
    equal: dict[str, object] = {}
    # quick: the first two recipes, no padding and a whole key block of it
    paddings = INVARIANT_PADDINGS[::2] if quick else INVARIANT_PADDINGS
    for n, recipe in enumerate(INVARIANT_RECIPES):
        if n >= 2 and (quick or time.perf_counter() - started > INVARIANT_BUDGET):
            equal[recipe] = {"skipped": "--quick" if quick else
                             f"the stage's {INVARIANT_BUDGET:.0f} s for bit checks were spent"}
            continue
        for label, compute in COMPUTE.items():
            equal[f"{recipe}.{label}"] = _engine_vs_trainer(device, recipe, label, compute,
                                                            paddings, refused)
    checked = {k: v for k, v in equal.items() if isinstance(v, dict) and "bit_equal" in v}
    return {"bit_equal": all(v["bit_equal"] for v in checked.values()), "checked": list(checked),
            "engine_vs_trainer": equal, "bit_checks_seconds": time.perf_counter() - started,
            "forward": _invariant_forward_speed(device, quick, refused),
            "gemm": _invariant_gemm_speed(device, refused), "refused": refused}


def _engine_vs_trainer(device: str, recipe: str, label: str, compute: torch.dtype,
                       paddings: Sequence[int], refused: list[str]) -> dict[str, object]:
    """A tiny Llama's rollout of nine prompts (three lengths, EOS mid-batch) and the
    trainer's log-probs of the same tokens at each micro-batch and extra padding: the
    largest difference from the engine's, and whether all are bit-equal."""
    import fp4rl
    from fp4rl.models import tiny_model
    from fp4rl.nn import get_recipe, quantize_model
    from fp4rl.rollout.batch import SamplingConfig
    from fp4rl.rollout.kv_cache import generate
    from fp4rl.rollout.logprobs import response_logprobs
    from fp4rl.rollout.sampling import row_generators

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 128, (n,), generator=g).tolist() for n in (5, 9, 13)]
    prompts = [p for p in prompts for _ in range(3)]
    model = quantize_model(tiny_model("llama")[0].eval().to(device), get_recipe(recipe),
                           batch_invariant=True)
    place = torch.device(device)
    with torch.no_grad(), fp4rl.rollout_mode(model), autocast(place, compute):
        batch = generate(model, prompts, SamplingConfig(max_new_tokens=12),
                         pad_token_id=PAD, eos_token_ids=list(EOS),
                         generator=row_generators(range(len(prompts)), device))
    ids, att = batch.sequences()
    mask = batch.response_mask.bool()
    width = batch.prompt_ids.shape[1]
    diffs: dict[str, float] = {}
    with torch.no_grad(), fp4rl.train_mode(model), autocast(place, compute):
        logits_dtype = computed_dtype(model(input_ids=ids[:1], attention_mask=att[:1],
                                            use_cache=False).logits)
        for pad in paddings:
            padded_ids = torch.cat([ids.new_full((len(ids), pad), PAD), ids], dim=1)
            padded_att = torch.cat([att.new_zeros((len(att), pad)), att], dim=1)
            for size in INVARIANT_MICRO_BATCHES:
                scored = torch.cat([
                    response_logprobs(model, padded_ids[i:i + size], padded_att[i:i + size],
                                      width + pad)[0]
                    for i in range(0, len(ids), size)])[mask]
                diffs[f"micro_batch={size} pad={pad}"] = \
                    float((scored - batch.logprobs[mask]).abs().max())
    if logits_dtype != dtype_name(compute):
        refused.append(f"invariant {recipe}.{label}: the model computed in {logits_dtype}, "
                       f"while the row says {dtype_name(compute)}")
    return {"computed_in": logits_dtype, "tokens": int(mask.sum()),
            "max_abs_diff": diffs, "bit_equal": all(d == 0 for d in diffs.values()),
            "finished_rows": int(batch.finished.sum())}


def _invariant_forward_speed(device: str, quick: bool, refused: list[str]) -> Record:
    """One scoring forward (the trainer's, no grad, bf16) of the same weights with and
    without ``batch_invariant``, for a plain and an FP4 recipe: seconds and their ratio."""
    import fp4rl
    from fp4rl.models import tiny_model
    from fp4rl.nn import get_recipe, quantize_model

    vocab = 128 if quick else 32000
    size: dict[str, object] = {"vocab_size": vocab} if quick else {
        "vocab_size": vocab, "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 128}
    rows, length = (9, 24) if quick else (8, 512)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab, (rows, length), generator=g).to(device)
    att = torch.ones_like(ids)
    place = torch.device(device)
    out: Record = {"shape": {"rows": rows, "tokens": length, **size}, "compute": "bfloat16"}
    base: torch.nn.Module = tiny_model("llama", seed=0, **size)[0]
    base.to(device)
    for recipe in ("bf16", "hif4"):
        # copies of one model: the same weights on both sides
        models = {name: quantize_model(copy.deepcopy(base), get_recipe(recipe),
                                       batch_invariant=invariant)
                  for name, invariant in (("default", False), ("batch_invariant", True))}

        def forward(model: torch.nn.Module) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                with torch.no_grad(), fp4rl.train_mode(model), \
                        autocast(place, torch.bfloat16):
                    logits: torch.Tensor = model(input_ids=ids, attention_mask=att,
                                                 use_cache=False).logits
                return logits
            return run

        sides = measure({name: forward(m) for name, m in models.items()},
                        repeats=2 if quick else 10)
        out[recipe] = {**{name: t.row() for name, t in sides.items()},
                       "ratio": ratio(f"invariant forward {recipe}", sides, "batch_invariant",
                                      "default", torch.bfloat16, refused)}
        del models
    return out


def _invariant_gemm_speed(device: str, refused: list[str]) -> Record:
    """``fp4rl::bi_mm`` (one tile configuration, no split K) against ``torch.mm`` in bf16
    at Qwen2.5-3B's up_proj, 512 tokens (on a GPU only: Triton compiles it there)."""
    if not device.startswith("cuda"):
        return {"skipped": "Triton's GEMM runs on a GPU"}
    from fp4rl.kernels import triton_invariant

    a = torch.randn(512, 2048, device=device, dtype=torch.bfloat16)
    w = torch.randn(11008, 2048, device=device, dtype=torch.bfloat16)
    sides = measure({"torch.mm": lambda: a @ w.t(),
                     "fp4rl::bi_mm": lambda: triton_invariant.bi_mm(a, w.t())}, repeats=20)
    return {"shape": [512, 2048, 11008], **{name: t.row() for name, t in sides.items()},
            "ratio": ratio("invariant gemm", sides, "fp4rl::bi_mm", "torch.mm",
                           torch.bfloat16, refused)}


def _seconds(fn: Callable[[], object], device: str, repeats: int) -> Timed:
    """Median seconds of ``fn`` and the dtype of what it returns: on a GPU replayed from a
    CUDA graph (no launch overhead, what a captured step pays), timed with CUDA events; on
    a CPU called directly."""
    dtype = computed_dtype(fn())  # also compiles what it launches, outside the capture
    if not device.startswith("cuda"):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return Timed(median(times), dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return Timed(median(times), dtype)


#: the training linear's token counts in the speed stage (Qwen2.5-3B's up_proj)
LINEAR_TOKENS = (512, 4096)
LINEAR_TOKENS_QUICK = (16,)
#: the FP4 recipes the speed stage times against bf16, each on both of its paths
LINEAR_RECIPES = ("hif4", "nvfp4")


def _linear_row(row: str, place: torch.device, m: int, k: int, n: int, micro: int,
                quick: bool, refused: list[str]) -> Record:
    """One optimizer step's ``micro`` forward + backward passes of bf16 ``nn.Linear`` and
    of the FP4 linear of each of :data:`LINEAR_RECIPES`, quantizing first and (where the
    device has the kernel) on load, side by side; the ratios to bf16 and on load to
    quantize-first, and the bytes each path moves (counted)."""
    from unittest import mock

    from fp4rl.bench import traffic
    from fp4rl.formats import get_format
    from fp4rl.kernels import has_qmm
    from fp4rl.nn import FP4Linear, get_recipe

    device = str(place)
    xs = [torch.randn(m, k, device=device, requires_grad=True) for _ in range(micro)]

    def step(layer: torch.nn.Module, on_load: bool = False) -> Callable[[], torch.Tensor]:
        flag = {"FP4RL_QUANTIZE_ON_LOAD": "1" if on_load else "0"}

        def go() -> torch.Tensor:
            layer.weight.grad = None
            # one optimizer step's micro-batches: the weights held as the trainer holds
            # them (Q(W) quantized at the first, kept for the rest; nothing kept before)
            held = fp4rl.nn.hold_weights(layer) if isinstance(layer, FP4Linear) \
                else contextlib.nullcontext()
            with held, mock.patch.dict(os.environ, flag):
                for xi in xs:
                    with autocast(place, torch.bfloat16):
                        y: torch.Tensor = layer(xi)
                    y.backward(torch.ones_like(y))
            return y
        return go

    def linear() -> torch.nn.Linear:
        return torch.nn.Linear(k, n, bias=False, device=device)

    calls = {"bf16": step(linear())}
    not_run: dict[str, str] = {}
    for recipe in LINEAR_RECIPES:
        calls[recipe] = step(FP4Linear.from_linear(linear(), get_recipe(recipe)))
        with mock.patch.dict(os.environ, {"FP4RL_QUANTIZE_ON_LOAD": "1"}):
            fused = has_qmm(get_format(recipe), place)
        if fused:
            calls[f"{recipe} on load"] = step(FP4Linear.from_linear(linear(),
                                                                    get_recipe(recipe)), True)
        else:
            not_run[f"{recipe} on load"] = f"no quantize-on-load kernel on {device}"
    sides = measure(calls, repeats=2 if quick else 10)
    out: Record = {"compute": "bfloat16", **{name: t.row() for name, t in sides.items()},
                   "ratio": {name: ratio(f"speed linear {row}", sides, name, "bf16",
                                         torch.bfloat16, refused)
                             for name in sides if name != "bf16"}}
    out["on load / quantize first"] = {
        recipe: ratio(f"speed linear {row}", sides, f"{recipe} on load", recipe,
                      torch.bfloat16, refused)
        for recipe in LINEAR_RECIPES if f"{recipe} on load" in sides}
    counted = {recipe: traffic.linear_traffic(recipe, (m, k, n), micro)
               for recipe in LINEAR_RECIPES}
    out["bytes_ratio"] = {name: counted[recipe].path_ratio(path)
                          for recipe in LINEAR_RECIPES
                          for name, path in ((recipe, "quantize_first"),
                                             (f"{recipe} on load", "on_load"))}
    out["not_run"] = not_run
    return out


#: the rollout linear's variants in the speed stage, each against ``bf16``
DECODE = ("bf16", "dequantized", "packed then GEMM", "fused packed kernel", "packed store")


def stage_speed(device: str, quick: bool) -> Record:
    """What only a GPU can time of the speed plan (docs/benchmarks.md), side by side in one
    process: each quantizer against a clone (CUDA-graph replays), the FP4 training linear
    (HiF4 and NVFP4, each quantizing first and on load) against bf16 at Qwen2.5-3B's
    up_proj, 512 and 4096 tokens, one and eight micro-batches (eager, with a profiler
    table of where the time goes), the rollout linear at 1 to 2048 tokens (bf16, the
    dequantized store, the packed store decoded then multiplied, the fused packed kernel,
    the packed store as it runs, and HiF4 + ResQ-2:4's activation pass and packed GEMM
    with its residual dense and n:m sparse), and the bytes each
    pass moves, counted (``bench linear --traffic``), to set the times against. Each row
    says its compute dtype and each side records the one it ran in."""
    from fp4rl.bench import traffic
    from fp4rl.formats import get_format
    from fp4rl.gemm import PackedCall, mm, mm_packed, pack_operand, packed_gemm, quantize_operand
    from fp4rl.kernels.triton_packed_mm import packed_mm_2d
    from fp4rl.nn import FP4Linear, get_recipe
    from fp4rl.recovery import make_recovery

    refused: list[str] = []
    place = torch.device(device)
    repeats = 2 if quick else 20
    side = 256 if quick else 8192
    x = torch.randn(side, side, device=device)
    clone = _seconds(lambda: x.clone(), device, repeats)
    quantizers: Record = {}
    for name in ("hif4", "mxfp4", "nvfp4", "mxfp8_e4m3"):
        fmt = get_format(name)
        quantized = _seconds(partial(fmt.quantize, x), device, repeats)
        quantizers[name] = {**quantized.row(), "share of clone bandwidth": ratio(
            f"speed quantizer {name}", {"clone": clone, name: quantized}, "clone", name,
            torch.float32, refused)}
    _, k, n = traffic.TARGET_SHAPE
    if quick:
        k, n = 64, 128
    linear: Record = {}
    for m in LINEAR_TOKENS_QUICK if quick else LINEAR_TOKENS:
        for micro in (1, 8):
            row = f"tokens={m} micro_batches={micro}"
            linear[row] = _linear_row(row, place, m, k, n, micro, quick, refused)
    m = LINEAR_TOKENS_QUICK[0] if quick else LINEAR_TOKENS[0]
    profile = ""
    if device.startswith("cuda") and not quick:
        layer = FP4Linear.from_linear(torch.nn.Linear(k, n, bias=False, device=device),
                                      get_recipe("hif4"))
        xi = torch.randn(m, k, device=device, requires_grad=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                with autocast(place, torch.bfloat16):
                    layer(xi).sum().backward()
        profile = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    decode: Record = {}
    w = torch.randn(n, k, device=device)
    wb = w.bfloat16()
    hif4 = get_format("hif4")
    qw = quantize_operand(w, hif4).to(torch.bfloat16)
    packed = pack_operand(w, hif4)
    fields = packed.row_fields()
    call = PackedCall.of(packed)
    rollout = get_recipe("hif4+resq-2:4").rollout
    resq = make_recovery(rollout.recovery, rollout.activations, k, 0,
                         weight_format=rollout.weights)
    for rows in ((1, 16) if quick else (1, 16, 64, 256, 2048)):
        a = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        qa = quantize_operand(a, hif4)
        calls: dict[str, Callable[[], object]] = {
            "bf16": partial(torch.mm, a, wb.t()),
            "dequantized": partial(mm, qa, qw.t(), torch.bfloat16),
            "packed then GEMM": partial(lambda q: mm(q, packed.decode(torch.bfloat16).t(),
                                                     torch.bfloat16), qa),
            "packed store": partial(mm_packed, qa, packed, torch.bfloat16)}
        if device.startswith("cuda"):
            # the fused kernel launched directly (no split along K), where Triton runs
            calls["fused packed kernel"] = partial(packed_mm_2d, hif4, qa.values.bfloat16(), 1,
                                                   fields, n, k, [qa.scale], None, None)
            # ResQ-2:4's activation pass and the packed GEMM: its residual as a dense bf16
            # term, and n:m sparse (expanded in the GEMM's registers: fewer bytes, more work)
            calls["resq dense terms"] = partial(
                lambda x: packed_gemm(resq.activation(x, torch.bfloat16), call, torch.bfloat16),
                a)
            calls["resq n:m residual"] = partial(
                lambda x: packed_gemm(resq.packed_activation(x, torch.bfloat16), call,
                                      torch.bfloat16), a)
        sides = {name: _seconds(fn, device, repeats) for name, fn in calls.items()}
        decode[str(rows)] = {
            "compute": "bfloat16", **{name: t.row() for name, t in sides.items()},
            "ratio to bf16": {name: ratio(f"speed decode rows={rows}", sides, name, "bf16",
                                          torch.bfloat16, refused)
                              for name in sides if name != "bf16"}}
    return {"device": device, "size": side, "clone": clone.row(), "quantizers": quantizers,
            "linear": linear, "decode": decode, "profile": profile, "refused": refused}


def stage_demo(device: str, quick: bool, output: Path) -> dict[str, Any]:
    from rich.console import Console

    from fp4rl.demo import DemoSize, run_demo

    # quick: one step of the smoke preset's size (the demo preset's step is 4x larger)
    size = DemoSize(steps=1, eval_prompts=2, reward_samples=1) if quick else DemoSize()
    started = time.perf_counter()
    with (output / "demo.log").open("w") as log:
        code = run_demo(Console(file=log, width=100), output=str(output / "demo"), size=size,
                        device=device, config="smoke" if quick else "demo")
    outcome = json.loads((output / "demo" / "outcome.json").read_text())
    return {"exit": code, "seconds": time.perf_counter() - started,
            "report": str(output / "demo" / "report.md"),
            "after": {k: v["mean@" + str(_k(v))] for k, v in outcome["after"].items()},
            "before": {k: v["mean@" + str(_k(v))] for k, v in outcome["before"].items()}}


#: the paper's recipe, and NVFP4 with the per-token activation scales an engine that pads
#: its batches under CUDA graphs needs
VLLM_RECIPES = ("hif4+resq-2:4", "nvfp4_per_token")
VLLM_PROMPTS = ("Question: what is 3 + 7? Answer:", "Tom has 4 apples and buys 9 more. How many?",
                "The capital of France is")


def stage_vllm(device: str, quick: bool, recipes: tuple[str, ...] = VLLM_RECIPES,
               send: Send = _no_figures) -> Record:
    """vLLM with the fp4rl method (compiled, CUDA graphs on, on a GPU): greedy completions
    and their log-probs against fp4rl's own rollout policy on the same tokens, before and
    after a refit from a changed trainer model."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise Skipped(f"vLLM is not installed ({err})") from err
    refused: list[str] = []
    results: Record = {}
    for recipe in recipes[:1] if quick else recipes:
        results[recipe] = _vllm_recipe(device, recipe, refused)
        # an engine start takes minutes: each recipe's figures are out before the next
        send("vllm", results[recipe], ("recipes", recipe))
    return {"recipes": results, "refused": refused}


def _vllm_recipe(device: str, recipe: str, refused: list[str]) -> Record:
    from vllm import SamplingParams

    from fp4rl.integrations.vllm import EngineSpec, make_llm, model_dir, refit
    from fp4rl.models import load_model
    from fp4rl.nn import get_recipe, quantize_model

    model = load_model("smollm2-135m", device=device)[0]
    quantize_model(model, get_recipe(recipe))
    started = time.perf_counter()
    llm = make_llm(EngineSpec(model_dir("smollm2-135m"), get_recipe(recipe), max_model_len=256,
                              kv_cache_bytes=256 << 20 if device == "cpu" else None,
                              gpu_memory_utilization=0.3))
    model_config = llm.llm_engine.vllm_config.model_config
    record: Record = {"start_seconds": time.perf_counter() - started,
                      "cuda_graphs": not model_config.enforce_eager,
                      "engine_dtype": dtype_name(model_config.dtype)}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    for phase in ("loaded", "refit"):
        if phase == "refit":
            g = torch.Generator(device=device).manual_seed(0)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g, device=device) * 0.01
                           * p.abs().mean())
            stats = refit(llm, model, packed=True)
            record["refit"] = {"seconds": stats.seconds, "bytes": stats.bytes}
        started = time.perf_counter()
        outs = llm.generate(list(VLLM_PROMPTS), params, use_tqdm=False)
        record[phase] = {"generate_seconds": time.perf_counter() - started,
                         **_against_fp4rl(model, outs, device)}
        if record[phase]["fp4rl_computed_in"] != "bfloat16":
            refused.append(f"vllm {recipe} {phase}: fp4rl's side computed in "
                           f"{record[phase]['fp4rl_computed_in']}, while the comparison "
                           "says bfloat16")
    del llm
    return record


def _against_fp4rl(model: torch.nn.Module, outs: list[Any], device: str) -> Record:
    """Each prompt's greedy tokens from vLLM scored by fp4rl's rollout policy (one full
    forward, bf16 compute): the largest log-prob difference, how many of vLLM's greedy
    tokens are fp4rl's argmax too, and the dtype fp4rl's logits came out in."""
    import fp4rl

    worst, agree, total = 0.0, 0, 0
    dtypes: set[str] = set()
    for out in outs:
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        given = [lp[t].logprob for t, lp in zip(out.outputs[0].token_ids,
                                                out.outputs[0].logprobs, strict=True)]
        with torch.no_grad(), fp4rl.rollout_mode(model), \
                autocast(torch.device(device), torch.bfloat16):
            raw: torch.Tensor = model(torch.tensor([ids], device=device)).logits[0]
        dtypes.add(computed_dtype(raw))
        start = len(out.prompt_token_ids) - 1
        logp = raw.float()[start:-1].log_softmax(-1)
        new = torch.tensor(out.outputs[0].token_ids, device=device)
        mine = logp.gather(1, new[:, None])[:, 0].cpu()
        worst = max(worst, float((mine - torch.tensor(given)).abs().max()))
        agree += int((logp.argmax(-1) == new).sum())
        total += len(new)
    return {"max_abs_logprob_diff": worst, "greedy_tokens_agreeing": f"{agree}/{total}",
            "fp4rl_computed_in": "+".join(sorted(dtypes))}


def _k(result: Mapping[str, Any]) -> int:
    return int(next(key for key in result if key.startswith("mean@")).split("@")[1])


class Skipped(Exception):
    """A stage that cannot run here (what it needs is not installed), and why."""


def run_stage(name: str, fn: Callable[[], Record], figures: Figures) -> Record:
    """Run one stage; its results or its error go to ``<stage>.json`` and the figures'
    lines. A stage that refused a ratio (a side computed in another dtype than its row
    says) ends ``error`` with that one line, its other figures kept."""
    print(f"{name} ...", flush=True)
    started = time.perf_counter()
    try:
        record: Record = {"status": "ok", **fn()}
    except Skipped as why:
        record = {"status": "skipped", "why": str(why)}
    except Exception as err:  # a stage's failure is a result too; the next stage runs
        record = {"status": "error", "error": f"{type(err).__name__}: {err}",
                  "traceback": traceback.format_exc()[-4000:]}
    refused = record.get("refused") or []
    if refused:
        more = f" (and {len(refused) - 1} more in {name}.json)" if len(refused) > 1 else ""
        record.update(status="error", error=f"{refused[0]}{more}")
    record["seconds"] = time.perf_counter() - started
    figures.record(name, record)
    status = record["status"] if record["status"] != "error" else \
        f"error: {str(record['error']).splitlines()[0]}"
    print(f"{name}: {status} in {record['seconds']:.0f} s", flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="toy sizes (a CPU dry run)")
    parser.add_argument("--output", type=Path, default=Path("runs/gpu-check"))
    parser.add_argument("--skip", nargs="*", default=[], help="stages to leave out")
    parser.add_argument("--only", nargs="*", default=[], help="run only these stages")
    parser.add_argument("--vllm-recipes", nargs="+", default=list(VLLM_RECIPES),
                        help="the recipes the vllm stage starts an engine for")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; run with --device cpu --quick to check the "
              "script itself", file=sys.stderr)
        return 2
    d, q, out = str(args.device), bool(args.quick), Path(args.output)
    lent = os.environ.get("OUT")
    figures = Figures([out, *([Path(lent) / "gpu-check"] if lent else [])])
    figures.rows("run", {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                         "argv": sys.argv[1:] if argv is None else argv})
    stages: dict[str, Callable[[], Record]] = {
        "tests": lambda: stage_tests(d, q), "formats": lambda: stage_formats(d, q),
        "linear": lambda: stage_linear(d, q), "rollout": lambda: stage_rollout(d, q),
        "train": lambda: stage_train(d, q),
        "vllm": lambda: stage_vllm(d, q, tuple(args.vllm_recipes), figures.rows),
        "demo": lambda: stage_demo(d, q, out), "invariant": lambda: stage_invariant(d, q),
        "speed": lambda: stage_speed(d, q)}
    unknown = sorted((set(args.only) | set(args.skip)) - set(stages))
    if unknown:
        print(f"gpu_check: no stage {', '.join(unknown)}; the stages are "
              f"{', '.join(stages)}", file=sys.stderr)
        return 2
    records = {name: run_stage(name, fn, figures) for name, fn in stages.items()
               if name not in args.skip and (not args.only or name in args.only)}
    summary = {"device": d, "device_name": device_name(d), "quick": q,
               "machine": common.machine(), "torch": torch.__version__,
               "stages": {n: {"status": r["status"], "seconds": r["seconds"]}
                          for n, r in records.items()}}
    figures.record("summary", summary)
    return 0 if all(r["status"] in ("ok", "skipped") for r in records.values()) else 1


__all__ = ["Figures", "Timed", "computed_dtype", "main", "ratio", "run_stage"]

if __name__ == "__main__":
    sys.exit(main())
