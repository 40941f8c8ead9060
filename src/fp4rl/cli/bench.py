"""``fp4rl bench``: speed and memory benchmarks, ratios measured side by side."""

from __future__ import annotations

import argparse

import torch
from rich.console import Console

from fp4rl.cli.options import add_device_option, check_outputs, positive_int, torch_gpu_name
from fp4rl.errors import UserError
from fp4rl.paths import write_json
from fp4rl.progress import status
from fp4rl.rollout.registry import list_engines


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``bench`` command's options."""
    bench = sub.add_parser("bench", help="speed benchmarks (ratios measured side by side)")
    bench.add_argument("what", choices=["formats", "linear", "rollout", "train", "engine",
                                        "invariant"],
                       help="engine: the vLLM rollout engine's memory, refit bytes and "
                       "speed, bf16 against the fp4rl method's two weight storages; "
                       "invariant: the batch-invariant forward against the default one")
    bench.add_argument("--recipe", help="invariant, linear --traffic, rollout --traffic: the "
                       "recipe (default hif4; --traffic also takes it as --format)")
    bench.add_argument("--model", default="smollm2-135m", help="model for rollout / train")
    bench.add_argument("--json", help="also write the results to this JSON file")
    bench.add_argument("--format", dest="formats", action="append",
                       help="limit to this format (repeatable)")
    bench.add_argument("--size", type=positive_int, default=4096,
                       help="square tensor side (formats)")
    add_device_option(bench, "cpu", " (formats on cuda: the Triton kernels)")
    bench.add_argument("--dim", type=int, default=-1, choices=[0, 1, -1],
                       help="formats: the axis to quantize along")
    bench.add_argument("--tokens", type=positive_int, help="linear: tokens per linear "
                       "(default 512); rollout: new tokens per prompt (default 32)")
    bench.add_argument("--engine", nargs="+", default=["hf"], choices=list_engines(),
                       help="rollout: fp4rl's engine (hf), vLLM with the fp4rl plug-in "
                       "(vllm), or both, measured side by side (default hf); train: vllm "
                       "compares the FP4 step with its rollout in vLLM against fp4rl's engine")
    bench.add_argument("--batch", type=positive_int, help="rollout: prompts per run "
                       "(default 8, or 32 with --engine vllm)")
    bench.add_argument("--mixed-precision", choices=["no", "bf16", "auto"],
                       help="rollout: the compute dtype of every policy and of the baseline: "
                       "no (fp32), bf16, auto (bf16 where the device has it natively, as "
                       "a training run resolves it); default auto. linear, invariant: the "
                       "one compute dtype to time (default: fp32 and bf16, bf16 only where "
                       "native)")
    bench.add_argument("--shapes", type=positive_int, help="only the first N linear shapes")
    bench.add_argument("--repeats", type=positive_int, default=5)
    bench.add_argument("--traffic", action="store_true",
                       help="linear: count the bytes each launch of an FP4 forward + "
                       "backward moves on a GPU (on the meta device, no GPU needed) against "
                       "bf16 nn.Linear's, with roofline times on an H100 and an H200; "
                       "rollout: the same for one vLLM-method linear at decode, each weight "
                       "storage (--format takes the recipe)")
    bench.add_argument("--shape", type=_shape, help="--traffic: tokens,in,out (default "
                       "512,2048,11008, Qwen2.5-3B's up_proj; rollout: 64 tokens)")
    bench.add_argument("--micro-batches", type=positive_int, default=1,
                       help="linear: forward + backward passes per optimizer step (the "
                       "FP4 layer derives Q(W) once a step; default 1)")
    bench.set_defaults(func=run)


def _shape(text: str) -> tuple[int, int, int]:
    """``M,K,N``: three positive integers."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not M,K,N (three positive integers, "
                                         "e.g. 512,2048,11008)")
    m, k, n = (int(p) for p in parts)
    return m, k, n


def run(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.bench import common
    from fp4rl.bench.rollout import check_engines
    from fp4rl.precision import describe_cpu, resolve_device

    check_outputs(json=args.json)
    if args.shape is not None and not args.traffic:
        raise UserError("--shape applies to bench linear/rollout --traffic only")
    if args.traffic and args.what not in ("linear", "rollout"):
        raise UserError("--traffic applies to bench linear and bench rollout only")
    if args.recipe is not None and args.what != "invariant" and not args.traffic:
        raise UserError("--recipe applies to bench invariant and bench linear/rollout "
                        "--traffic only")
    if args.micro_batches != 1 and args.what != "linear":
        raise UserError("--micro-batches applies to bench linear only")
    if args.what in ("formats", "linear", "engine") and args.engine != ["hf"]:
        raise UserError("--engine applies to bench rollout and bench train only")
    if args.what not in ("rollout", "engine", "invariant") and args.batch is not None:
        raise UserError("--batch applies to bench rollout, engine and invariant only")
    if args.mixed_precision is not None and (args.what not in ("rollout", "invariant",
                                                               "linear") or args.traffic):
        raise UserError("--mixed-precision applies to bench rollout, linear and invariant "
                        "only (not --traffic)")
    # vLLM missing: one line, before any loading
    engines = check_engines(["vllm"] if args.what == "engine" else args.engine)
    device = resolve_device(args.device)
    console.print(describe_cpu() + (f"; GPU: {torch_gpu_name()}" if device.type == "cuda"
                                    else ""), markup=False)
    report = _BENCHMARKS[args.what](args, console, device, engines)
    console.print(f"machine: {common.machine()}")
    if args.json:
        write_json(args.json, {"cpu": describe_cpu(), "machine": common.machine(), **report}
                   if args.what == "engine" else report)
        console.print(f"wrote {args.json}")
    return 0


def _formats(args: argparse.Namespace, console: Console, device: torch.device,
             engines: tuple[str, ...]) -> dict:
    from fp4rl.bench import common
    from fp4rl.bench import formats as bench

    with status(console, "benchmarking the quantizers"):
        results = bench.run(formats=args.formats or bench.DEFAULT_FORMATS, size=args.size,
                            repeats=args.repeats, device=args.device, dim=args.dim)
    bench.render(results, console, args.size)
    return common.report(results, benchmark="formats", size=args.size)


def _rollout(args: argparse.Namespace, console: Console, device: torch.device,
             engines: tuple[str, ...]) -> dict:
    from fp4rl.bench import common
    from fp4rl.bench import rollout as bench

    if args.traffic:
        return _rollout_traffic(args, console)
    from fp4rl.precision import resolve_mixed_precision

    batch, new_tokens = args.batch or bench.default_batch(engines), args.tokens or 32
    precision = resolve_mixed_precision(args.mixed_precision or "auto", device)
    with status(console, f"benchmarking generation ({', '.join(engines)})"):
        results, tokens = bench.run(args.model, batch=batch, new_tokens=new_tokens,
                                    repeats=args.repeats, device=device, engines=engines,
                                    mixed_precision=precision)
    bench.render(results, tokens, console)
    return common.report(results, benchmark="rollout", size=args.size, engines=list(engines),
                         batch=batch, new_tokens=new_tokens, mixed_precision=precision)


def _engine(args: argparse.Namespace, console: Console, device: torch.device,
            engines: tuple[str, ...]) -> dict:
    from fp4rl.bench import engine as bench

    with status(console, "benchmarking vLLM engines, one process each"):
        rows = bench.run(args.model, batch=args.batch or 8, new_tokens=args.tokens or 16,
                         repeats=args.repeats)
    bench.render(rows, console)
    return {"benchmark": "engine", "rows": rows}


def _linear(args: argparse.Namespace, console: Console, device: torch.device,
            engines: tuple[str, ...]) -> dict:
    from fp4rl.bench import common
    from fp4rl.bench import linear as bench

    if args.traffic:
        return _traffic(args, console, _traffic_recipe(args))
    fmt = (args.formats or ["hif4"])[0]
    shapes = bench.SHAPES if args.tokens is None else tuple(
        (name, args.tokens, d, n) for name, _, d, n in bench.SHAPES)
    asked = _computes(args, device, console)
    computes = tuple(c for c in bench.COMPUTES if c in asked)
    with status(console, f"benchmarking the {fmt} linear"):
        results = bench.run(fmt, shapes[: args.shapes], repeats=args.repeats, device=device,
                            micro_batches=args.micro_batches, computes=computes)
    bench.render(results, console, args.micro_batches)
    return common.report(results, benchmark="linear", size=args.size,
                         micro_batches=args.micro_batches, computes=list(computes))


def _computes(args: argparse.Namespace, device: torch.device, console: Console
              ) -> frozenset[str]:
    """The compute dtypes a side-by-side bench times (``fp32``, ``bf16``): the one
    ``--mixed-precision`` resolves to, else both where ``device`` has bf16 natively and
    fp32 alone where it would emulate it (minutes a repeat, and no run there computes in
    it), said in one line."""
    from fp4rl.bench.rollout import COMPUTE
    from fp4rl.precision import native_bf16, resolve_mixed_precision

    if args.mixed_precision is not None:
        return frozenset({COMPUTE[resolve_mixed_precision(args.mixed_precision, device)]})
    if native_bf16(device):
        return frozenset({"fp32", "bf16"})
    console.print("bf16 not timed: this CPU emulates it, and a run here computes in fp32 "
                  "(--mixed-precision bf16 times it anyway)", markup=False)
    return frozenset({"fp32"})


def _traffic_recipe(args: argparse.Namespace) -> str:
    """The recipe a ``--traffic`` count runs: ``--recipe``, or ``--format`` (which names
    it too), default hif4; both naming different ones is refused in one line."""
    formats = args.formats or []
    if len(formats) > 1:
        raise UserError("--traffic counts one recipe: give --format once")
    if args.recipe is not None and formats and formats[0] != args.recipe:
        raise UserError(f"--recipe {args.recipe} and --format {formats[0]} name two recipes; "
                        "--traffic counts one: give one of them")
    return args.recipe or (formats or ["hif4"])[0]


def _rollout_traffic(args: argparse.Namespace, console: Console) -> dict:
    from fp4rl.bench import traffic
    from fp4rl.nn import get_recipe

    recipe = _traffic_recipe(args)
    get_recipe(recipe)  # an unknown name: one line, before any work
    m, k, n = args.shape or (traffic.ROLLOUT_TARGET[0], *traffic.TARGET_SHAPE[1:])
    result = traffic.rollout_traffic(recipe, m, (k, n))
    traffic.render_rollout(result, console)
    return {"benchmark": "rollout-traffic", **result.as_dict()}


def _traffic(args: argparse.Namespace, console: Console, fmt: str) -> dict:
    from fp4rl.bench import traffic
    from fp4rl.nn import get_recipe

    get_recipe(fmt)  # an unknown name: one line, before any work
    with status(console, f"counting the bytes of the {fmt} linear"):
        result = traffic.linear_traffic(fmt, args.shape or traffic.TARGET_SHAPE,
                                        args.micro_batches)
    traffic.render(result, console)
    return {"benchmark": "linear-traffic", **result.as_dict()}


def _train(args: argparse.Namespace, console: Console, device: torch.device,
           engines: tuple[str, ...]) -> dict:
    from fp4rl.bench import common
    from fp4rl.bench import train as bench

    with status(console, "benchmarking a GRPO step"):
        results = bench.run(args.model, repeats=args.repeats, device=str(device),
                            engine="vllm" if "vllm" in engines else "hf")
    bench.render(results, console)
    return common.report(results, benchmark="train", size=args.size)


def _invariant(args: argparse.Namespace, console: Console, device: torch.device,
               engines: tuple[str, ...]) -> dict:
    from fp4rl.bench import common
    from fp4rl.bench import invariant as bench
    from fp4rl.nn import get_recipe

    if device.type != "cpu":
        raise UserError("bench invariant times the CPU kernels (--device cpu); on a GPU "
                        "vLLM's batch-invariant mode is the tool")
    recipe = args.recipe or "hif4"
    get_recipe(recipe)  # an unknown recipe: one line, before loading
    batch, new_tokens = args.batch or 8, args.tokens or 32
    asked = _computes(args, device, console)
    computes = tuple(c for c in ("fp32", "bf16") if c in asked)
    with status(console, "benchmarking the batch-invariant forward"):
        results, tokens = bench.run(args.model, recipe, batch=batch, new_tokens=new_tokens,
                                    repeats=args.repeats, computes=computes)
    bench.render(results, console, recipe, batch, new_tokens, tokens)
    return common.report(results, benchmark="invariant", recipe=recipe, batch=batch,
                         new_tokens=new_tokens, score_tokens=tokens, computes=list(computes))


#: each benchmark: run it, print its table, return what ``--json`` writes
_BENCHMARKS = {"formats": _formats, "rollout": _rollout, "engine": _engine,
               "linear": _linear, "train": _train, "invariant": _invariant}
