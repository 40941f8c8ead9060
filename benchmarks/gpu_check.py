"""Everything fp4rl checks on a GPU, in one process, with every result written down.

A GPU is lent rarely and for minutes, so the checks must run in one call and survive a
failing stage: each stage runs, is timed, and writes ``<output>/<stage>.json`` (its
results, or the error that stopped it); ``<output>/summary.json`` lists every stage with
the device's name. The stages:

1. ``tests``: the CUDA tests (every Triton operation bit-exact against the reference for
   every format, axis, dtype and token count; the rollout operations captured in CUDA
   graphs at sizes never run eagerly; a CUDA GRPO step against the CPU one), through pytest;
2. ``formats``: ``bench formats`` at 8192 x 8192, with each quantizer's GB/s (one read and
   one write of every float32 value) and its share of a clone's, the copy bandwidth;
3. ``linear``: ``bench linear`` at the Qwen2.5-3B shapes, FP4 against bf16;
4. ``rollout`` and ``train``: ``bench rollout`` and ``bench train`` on the embedded model;
5. ``vllm``: an engine per recipe with the fp4rl method (compiled, CUDA graphs on), its
   greedy log-probs against fp4rl's rollout policy before and after a refit (skipped
   where vLLM is not installed; each recipe's figures are printed as they exist);
6. ``demo``: ``fp4rl demo`` on the device, its wall clock and report;
7. ``invariant``: on-policy to the bit on the device: a tiny Llama with ``batch_invariant``
   (the Triton GEMM ``fp4rl::bi_mm``; torch's CUDA softmax and mean), the engine's
   log-probs against the trainer's for ``bf16`` and ``hif4`` in fp32 and bf16, and the
   GEMM's time against ``torch.mm`` at 512 x 2048 -> 11008;
8. ``speed``: each quantizer against a clone from CUDA-graph replays, the FP4 training
   linear against bf16 with one and eight micro-batches (and a profiler table), the rollout
   linear at 1-256 tokens (bf16, dequantized, packed then GEMM), beside the bytes counted
   by ``bench linear --traffic``. On a GPU run it first: ``--only speed``.

``--only`` and ``--skip`` choose stages. docs/gpu.md says how to carry vLLM and the embedded
model to a GPU machine without network, and holds the runs.

``--device cpu --quick`` runs every stage at toy sizes in well under two minutes on a
2-core CPU, so the script is known to work before a GPU is ever lent
(``tests/bench/test_gpu_check.py``)::

    python benchmarks/gpu_check.py --output runs/gpu-check            # on the GPU machine
    python benchmarks/gpu_check.py --device cpu --quick --output /tmp/check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import torch

from fp4rl.bench import common
from fp4rl.precision import autocast, describe_cpu

ROOT = Path(__file__).resolve().parents[1]


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return describe_cpu()


def stage_tests(device: str, quick: bool) -> dict[str, Any]:
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


def stage_formats(device: str, quick: bool) -> dict[str, Any]:
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


def stage_linear(device: str, quick: bool) -> dict[str, Any]:
    from fp4rl.bench import linear

    shapes = tuple(s for s in linear.SHAPES if s[0].startswith("qwen2.5-3b"))
    if quick:
        shapes = tuple((name, 16, d, n) for name, _, d, n in shapes[:1])
    return common.report(linear.run("hif4", shapes, repeats=1 if quick else 5,
                                    device=device))


def stage_rollout(device: str, quick: bool) -> dict[str, Any]:
    from fp4rl.bench import rollout

    results, tokens = rollout.run(batch=2 if quick else 8, new_tokens=4 if quick else 32,
                                  repeats=1 if quick else 3, device=device)
    return {"tokens": tokens, **common.report(results)}


def stage_train(device: str, quick: bool) -> dict[str, Any]:
    from fp4rl.bench import train

    changes = {"grpo.batch_size": 1, "grpo.num_generations": 2, "grpo.micro_batch_size": 2,
               "grpo.max_response_length": 4} if quick else None
    return common.report(train.run(repeats=1 if quick else 3, changes=changes,
                                   device=device))


def stage_invariant(device: str, quick: bool) -> dict[str, Any]:
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
    equal: dict[str, object] = {}
    for recipe in ("bf16", "hif4"):
        for label, mp in (("fp32", "no"), ("bf16", "bf16")):
            model = quantize_model(tiny_model("llama")[0].eval().to(device), get_recipe(recipe),
                                   batch_invariant=True)
            with torch.no_grad(), fp4rl.rollout_mode(model), autocast(torch.device(device), mp):
                batch = generate(model, prompts, SamplingConfig(max_new_tokens=12),
                                 pad_token_id=3, eos_token_ids=[2, 7, 9],
                                 generator=row_generators(range(9), device))
            ids, att = batch.sequences()
            mask = batch.response_mask.bool()
            with torch.no_grad(), fp4rl.train_mode(model), autocast(torch.device(device), mp):
                diffs = [(torch.cat([response_logprobs(model, ids[i:i + n], att[i:i + n],
                                                       batch.prompt_ids.shape[1])[0]
                                     for i in range(0, 9, n)])[mask]
                          - batch.logprobs[mask]).abs().max().item() for n in (9, 4, 1)]
            equal[f"{recipe}.{label}"] = {"max_abs_diff_by_micro_batch": diffs,
                                          "bit_equal": all(d == 0 for d in diffs)}
    timing: dict[str, float] = {}
    if device.startswith("cuda") and not quick:
        from fp4rl.kernels import triton_invariant

        a = torch.randn(512, 2048, device=device, dtype=torch.bfloat16)
        w = torch.randn(11008, 2048, device=device, dtype=torch.bfloat16)
        times = common.measure({"torch.mm": lambda: a @ w.t(),
                                "fp4rl::bi_mm": lambda: triton_invariant.bi_mm(a, w.t())},
                               repeats=20)
        timing = {k: t.median for k, t in times.items()}
    return {"engine_vs_trainer": equal, "gemm_seconds": timing}


def _seconds(fn: Callable[[], Any], device: str, repeats: int) -> float:
    """Median seconds of ``fn``: on a GPU replayed from a CUDA graph (no launch overhead,
    what a captured step pays), timed with CUDA events; on a CPU called directly."""
    fn()  # compiles what it launches, outside the capture
    if not device.startswith("cuda"):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return median(times)
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
    return median(times)


def stage_speed(device: str, quick: bool) -> dict[str, Any]:
    """What only a GPU can time of the speed plan (docs/benchmarks.md), side by side in one
    process: each quantizer against a clone (CUDA-graph replays), the FP4 training linear
    against bf16 at Qwen2.5-3B's up_proj with one and eight micro-batches (eager, with a
    profiler table of where the time goes), the rollout linear at decode sizes (bf16, the
    dequantized store, the packed store decoded then multiplied, the fused packed kernel,
    and the packed store as it runs: fused up to its token count), and the bytes each
    pass moves, counted (``bench linear --traffic``), to set the times against."""
    from fp4rl.bench import traffic
    from fp4rl.formats import get_format
    from fp4rl.gemm import mm, mm_packed, pack_operand, quantize_operand
    from fp4rl.kernels.triton_packed_mm import packed_mm_2d
    from fp4rl.nn import FP4Linear, get_recipe

    repeats = 2 if quick else 20
    side = 256 if quick else 8192
    x = torch.randn(side, side, device=device)
    clone = _seconds(lambda: x.clone(), device, repeats)
    quantizers = {}
    for name in ("hif4", "mxfp4", "nvfp4", "mxfp8_e4m3"):
        fmt = get_format(name)
        t = _seconds(lambda fmt=fmt: fmt.quantize(x), device, repeats)
        quantizers[name] = {"seconds": t, "share of clone bandwidth": clone / t}
    m, k, n = (16, 64, 128) if quick else traffic.TARGET_SHAPE
    linear: dict[str, Any] = {}
    for micro in (1, 8):
        layers = {"bf16": torch.nn.Linear(k, n, bias=False, device=device),
                  "hif4": FP4Linear.from_linear(torch.nn.Linear(k, n, bias=False,
                                                                device=device),
                                                get_recipe("hif4"))}
        xs = [torch.randn(m, k, device=device, requires_grad=True) for _ in range(micro)]

        def step(layer: torch.nn.Module, xs: list[torch.Tensor] = xs) -> Callable[[], None]:
            def go() -> None:
                layer.weight.grad = None
                if isinstance(layer, FP4Linear):
                    layer._kept.clear()  # a new optimizer step's first pass
                for xi in xs:
                    with autocast(torch.device(device), "bf16"):
                        y = layer(xi)
                    y.backward(torch.ones_like(y))
            return go
        times = common.measure({name: step(layer) for name, layer in layers.items()},
                               repeats=2 if quick else 10)
        bytes_ = traffic.linear_traffic("hif4", (m, k, n), micro)
        linear[f"micro_batches={micro}"] = {
            "seconds": {name: t.median for name, t in times.items()},
            "ratio": times["hif4"].median / times["bf16"].median,
            "bytes_ratio": bytes_.ratio}
    profile = ""
    if device.startswith("cuda") and not quick:
        layer = FP4Linear.from_linear(torch.nn.Linear(k, n, bias=False, device=device),
                                      get_recipe("hif4"))
        xi = torch.randn(m, k, device=device, requires_grad=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                with autocast(torch.device(device), "bf16"):
                    layer(xi).sum().backward()
        profile = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    decode: dict[str, Any] = {}
    w = torch.randn(n, k, device=device)
    wb = w.bfloat16()
    qw = quantize_operand(w, "hif4").to(torch.bfloat16)
    packed = pack_operand(w, "hif4")
    fields = packed.row_fields()
    for rows in ((1, 16) if quick else (1, 16, 64, 128, 256)):
        a = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        qa = quantize_operand(a, "hif4")
        decode[str(rows)] = {
            "bf16": _seconds(lambda a=a: a @ wb.t(), device, repeats),
            "dequantized": _seconds(lambda qa=qa: mm(qa, qw.t(), torch.bfloat16), device,
                                    repeats),
            "packed then GEMM": _seconds(
                lambda qa=qa: mm(qa, packed.decode(torch.bfloat16).t(), torch.bfloat16),
                device, repeats),
            # the fused kernel at every size (to place FUSED_MAX_ROWS), where Triton runs
            "fused packed kernel": _seconds(
                lambda qa=qa: packed_mm_2d(get_format("hif4"), qa.values.bfloat16(), 1,
                                           fields, n, k, [qa.scale], None, None),
                device, repeats) if device.startswith("cuda") else None,
            "packed store": _seconds(lambda qa=qa: mm_packed(qa, packed, torch.bfloat16),
                                     device, repeats)}
    return {"clone_seconds": clone, "size": side, "quantizers": quantizers,
            "linear": linear, "profile": profile, "decode_seconds": decode}


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


def stage_vllm(device: str, quick: bool, recipes: tuple[str, ...] = VLLM_RECIPES
               ) -> dict[str, Any]:
    """vLLM with the fp4rl method (compiled, CUDA graphs on, on a GPU): greedy completions
    and their log-probs against fp4rl's own rollout policy on the same tokens, before and
    after a refit from a changed trainer model."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise Skipped(f"vLLM is not installed ({err})") from err
    results = {}
    for recipe in recipes[:1] if quick else recipes:
        results[recipe] = _vllm_recipe(device, recipe)
        # an engine start takes minutes: each recipe's figures are out before the next
        print("vllm", recipe, json.dumps(results[recipe]), flush=True)
    return {"recipes": results}


def _vllm_recipe(device: str, recipe: str) -> dict[str, Any]:
    from vllm import SamplingParams

    from fp4rl.integrations.vllm import EngineSpec, make_llm, model_dir, refit
    from fp4rl.models import load_model
    from fp4rl.nn import quantize_model

    model, tok = load_model("smollm2-135m")
    model.to(device)
    quantize_model(model, recipe)
    started = time.perf_counter()
    llm = make_llm(EngineSpec(model_dir("smollm2-135m"), recipe, max_model_len=256,
                              kv_cache_bytes=256 << 20 if device == "cpu" else None,
                              gpu_memory_utilization=0.3))
    record: dict[str, Any] = {"start_seconds": time.perf_counter() - started,
                              "cuda_graphs": not llm.llm_engine.vllm_config.model_config
                              .enforce_eager}
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
                         **_against_fp4rl(model, tok, outs, device)}
    del llm
    return record


def _against_fp4rl(model: torch.nn.Module, tok: Any, outs: list[Any], device: str
                   ) -> dict[str, Any]:
    """Each prompt's greedy tokens from vLLM scored by fp4rl's rollout policy (one full
    forward, bf16 compute): the largest log-prob difference, and how many of vLLM's greedy
    tokens are fp4rl's argmax too."""
    import fp4rl

    worst, agree, total = 0.0, 0, 0
    for out in outs:
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        given = [lp[t].logprob for t, lp in zip(out.outputs[0].token_ids,
                                                out.outputs[0].logprobs, strict=True)]
        with torch.no_grad(), fp4rl.rollout_mode(model), autocast(torch.device(device), "bf16"):
            logits = model(torch.tensor([ids], device=device)).logits[0].float()
        start = len(out.prompt_token_ids) - 1
        logp = logits[start:-1].log_softmax(-1)
        new = torch.tensor(out.outputs[0].token_ids, device=device)
        mine = logp.gather(1, new[:, None])[:, 0].cpu()
        worst = max(worst, float((mine - torch.tensor(given)).abs().max()))
        agree += int((logp.argmax(-1) == new).sum())
        total += len(new)
    return {"max_abs_logprob_diff": worst, "greedy_tokens_agreeing": f"{agree}/{total}"}


def _k(result: dict[str, Any]) -> int:
    return int(next(key for key in result if key.startswith("mean@")).split("@")[1])


class Skipped(Exception):
    """A stage that cannot run here (what it needs is not installed), and why."""


def run_stage(name: str, fn: Callable[[], dict[str, Any]], output: Path) -> dict[str, Any]:
    """Run one stage; its results or its error go to ``<output>/<name>.json``."""
    print(f"{name} ...", flush=True)
    started = time.perf_counter()
    try:
        record = {"status": "ok", **fn()}
    except Skipped as why:
        record = {"status": "skipped", "why": str(why)}
    except Exception as err:  # a stage's failure is a result too; the next stage runs
        record = {"status": "error", "error": f"{type(err).__name__}: {err}",
                  "traceback": traceback.format_exc()[-4000:]}
    record["seconds"] = time.perf_counter() - started
    (output / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
    print(f"{name}: {record['status']} in {record['seconds']:.0f} s", flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    args.output.mkdir(parents=True, exist_ok=True)
    d, q, out = args.device, args.quick, args.output
    stages: dict[str, Callable[[], dict[str, Any]]] = {
        "tests": lambda: stage_tests(d, q), "formats": lambda: stage_formats(d, q),
        "linear": lambda: stage_linear(d, q), "rollout": lambda: stage_rollout(d, q),
        "train": lambda: stage_train(d, q),
        "vllm": lambda: stage_vllm(d, q, tuple(args.vllm_recipes)),
        "demo": lambda: stage_demo(d, q, out), "invariant": lambda: stage_invariant(d, q),
        "speed": lambda: stage_speed(d, q)}
    records = {name: run_stage(name, fn, out) for name, fn in stages.items()
               if name not in args.skip and (not args.only or name in args.only)}
    summary = {"device": d, "device_name": device_name(d), "quick": q,
               "machine": common.machine(), "torch": torch.__version__,
               "stages": {n: {"status": r["status"], "seconds": r["seconds"]}
                          for n, r in records.items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary["stages"]))
    return 0 if all(r["status"] in ("ok", "skipped") for r in records.values()) else 1


__all__ = ["main", "run_stage"]

if __name__ == "__main__":
    sys.exit(main())
