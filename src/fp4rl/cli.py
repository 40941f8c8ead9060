"""The ``fp4rl`` command line."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from rich.console import Console

from fp4rl.errors import UserError
from fp4rl.paths import write_json, write_text_atomic
from fp4rl.progress import status
from fp4rl.rollout.registry import ALIASES, list_engines

if TYPE_CHECKING:
    from rich.table import Table

    from fp4rl.analysis.gradients import FormatGradients
    from fp4rl.experiments import Cell, Experiment
    from fp4rl.rl.config import TrainConfig


def _bench(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.bench import common
    from fp4rl.precision import describe_cpu, resolve_device

    _check_outputs(json=args.json)
    from fp4rl.bench.rollout import check_engines, default_batch
    from fp4rl.errors import UserError

    if args.what in ("formats", "linear", "engine") and args.engine != ["hf"]:
        raise UserError("--engine applies to bench rollout and bench train only")
    if args.what not in ("rollout", "engine") and args.batch is not None:
        raise UserError("--batch applies to bench rollout and bench engine only")
    engines = check_engines(["vllm"] if args.what == "engine" else args.engine)  # vLLM
    # missing: one line, before any loading
    extra: dict[str, object] = {}
    if args.what == "rollout":
        batch, new_tokens = args.batch or default_batch(engines), args.tokens or 32
        extra = {"engines": list(engines), "batch": batch, "new_tokens": new_tokens}
    device = resolve_device(args.device)
    console.print(describe_cpu() + (f"; GPU: {torch_gpu_name()}" if device.type == "cuda"
                                    else ""), markup=False)
    if args.what == "formats":
        from fp4rl.bench import formats as bench

        with status(console, "benchmarking the quantizers"):
            results = bench.run(formats=args.formats or bench.DEFAULT_FORMATS,
                                size=args.size, repeats=args.repeats, device=args.device,
                                dim=args.dim)
        bench.render(results, console, args.size)
    elif args.what == "rollout":
        from fp4rl.bench import rollout as bench

        with status(console, f"benchmarking generation ({', '.join(engines)})"):
            results, tokens = bench.run(args.model, batch=batch, new_tokens=new_tokens,
                                        repeats=args.repeats, device=device, engines=engines)
        bench.render(results, tokens, console)
    elif args.what == "engine":
        from fp4rl.bench import engine as bench

        with status(console, "benchmarking vLLM engines, one process each"):
            rows = bench.run(args.model, batch=args.batch or 8,
                             new_tokens=args.tokens or 16, repeats=args.repeats)
        bench.render(rows, console)
        console.print(f"machine: {common.machine()}")
        if args.json:
            write_json(args.json, {"benchmark": "engine", "cpu": describe_cpu(),
                                   "machine": common.machine(), "rows": rows})
            console.print(f"wrote {args.json}")
        return 0
    elif args.what == "linear":
        from fp4rl.bench import linear as bench

        fmt = (args.formats or ["hif4"])[0]
        shapes = bench.SHAPES if args.tokens is None else tuple(
            (name, args.tokens, d, n) for name, _, d, n in bench.SHAPES)
        with status(console, f"benchmarking the {fmt} linear"):
            results = bench.run(fmt, shapes[: args.shapes], repeats=args.repeats,
                                device=device)
        bench.render(results, console)
    else:  # train
        from fp4rl.bench import train as bench

        with status(console, "benchmarking a GRPO step"):
            results = bench.run(args.model, repeats=args.repeats, device=str(device),
                                engine="vllm" if "vllm" in engines else "hf")
        bench.render(results, console)
    console.print(f"machine: {common.machine()}")
    if args.json:
        write_json(args.json, common.report(results, benchmark=args.what, size=args.size,
                                            **extra))
        console.print(f"wrote {args.json}")
    return 0


def _check_outputs(**paths: str | None) -> None:
    """Refuse, before any work, an ``--output`` directory or a ``--json``/``--plot`` file
    that could not be written (the work would be lost at the end)."""
    from fp4rl.paths import check_writable

    for option, path in paths.items():
        if path:
            check_writable(path, f"--{option}", directory=option == "output")


def torch_gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()


def _diagnose(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    _check_diagnose_args(args)
    _check_outputs(output=args.out, json=args.json)
    if args.gradients:
        return _diagnose_gradients(args, console)
    from fp4rl.analysis import diagnose, plots
    from fp4rl.analysis.activations import capture_linear_inputs
    from fp4rl.analysis.prompts import encode_prompts, load_prompts
    from fp4rl.formats import get_format
    from fp4rl.models import load_model

    formats = [get_format(f).name for f in (args.formats or ["hif4", "mxfp4"])]
    prompts = load_prompts(args.prompts)
    out = Path(args.out)
    from fp4rl.precision import resolve_device

    with status(console, f"loading {args.model}"):
        model, tok = load_model(args.model, device=resolve_device(args.device))
    with status(console, f"capturing block linear inputs over {len(prompts)} prompts"):
        acts = capture_linear_inputs(model, encode_prompts(tok, prompts))
    layers = [diagnose.diagnose_activations(n, x, formats)
              for n, x in track(acts.items(), "diagnosing layers", console)]
    out.mkdir(parents=True, exist_ok=True)  # once there is something to put there
    series = ["bf16", *formats]
    plots.per_layer_type(layers, series, lambda d, s: d.zero_frac[s], "% exactly zero",
                         f"{args.model}: zero collapse of linear inputs", out / "zero_frac.png")
    plots.per_layer_type(layers, formats, lambda d, s: d.outlier_block_frac[s],
                         "% blocks with outlier", f"{args.model}: outlier blocks",
                         out / "outlier_blocks.png")
    plots.plot_sparsify_error(layers, formats, out / "sparsify_error.png")
    worst = max(layers, key=lambda d: d.zero_frac[formats[0]])
    plots.plot_heatmaps(acts[worst.name], formats[0], worst.name, out / "heatmap.png")
    table = Table(title="means over layers: share of zeros, of outlier blocks, and the 2:4 "
                        "RMSE of the residual relative to that of Q(X)")
    table.add_column("layers")
    for col in (*(f"0s {s}" for s in series), *(f"outl {f}" for f in formats),
                *(f"2:4 res/QX {f}" for f in formats)):
        table.add_column(col, justify="right")
    for kind in ("", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                 "down_proj"):
        m = diagnose.summarize(layers, formats, kind)
        table.add_row(kind.removesuffix("_proj") or "all",
                      *(f"{m['zero_frac'][s]:.1%}" for s in series),
                      *(f"{m['outlier_block_frac'][f]:.1%}" for f in formats),
                      *(f"{m['sparsify_rmse_residual'][f] / m['sparsify_rmse_qx'][f]:.2f}"
                        for f in formats))
    console.print(table)
    json_path = Path(args.json) if args.json else out / "diagnose.json"
    write_json(json_path, diagnose.report(args.model, formats, layers))
    console.print(f"plots in {out}/, data in {json_path}")
    return 0


#: ``fp4rl diagnose`` options of the gradient diagnosis, and their defaults
GRADIENT_OPTIONS = {"n": 8, "num_generations": 4, "max_new_tokens": 64, "temperature": 0.8,
                    "seed": 0, "levels": [1, 2], "max_sequences": 16}


def _check_diagnose_args(args: argparse.Namespace) -> None:
    """Each of the two diagnoses takes only its own options; fill in the defaults."""
    from fp4rl.errors import UserError

    given = [k for k in GRADIENT_OPTIONS if getattr(args, k) is not None]
    if args.gradients and args.prompts:
        raise UserError("--prompts chooses the prompts of the activation diagnosis; "
                        "--gradients samples the built-in arithmetic task (use --n, --levels)")
    if not args.gradients and given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise UserError(f"only with --gradients: {flags}")
    for key, default in GRADIENT_OPTIONS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    _check_gradient_values(args)


def _check_gradient_values(args: argparse.Namespace) -> None:
    """Refuse, in one line, a value the gradient diagnosis cannot sample with."""
    from fp4rl.data.synthetic import LEVELS
    from fp4rl.errors import UserError

    least = {"n": 1, "num_generations": 2, "max_new_tokens": 1, "max_sequences": 1}
    for key, low in least.items():
        if getattr(args, key) < low:
            raise UserError(f"--{key.replace('_', '-')} must be at least {low}")
    if not args.temperature > 0:
        raise UserError("--temperature must be > 0")
    if not args.levels or set(args.levels) - set(LEVELS):
        raise UserError(f"--levels: choose among {sorted(LEVELS)}")


def _diagnose_gradients(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.analysis import gradients, plots
    from fp4rl.formats import get_format
    from fp4rl.models import load_model
    from fp4rl.precision import resolve_device

    formats = [get_format(f).name for f in (args.formats or ["hif4", "mxfp4"])]
    out = Path(args.out)
    with status(console, f"loading {args.model}"):
        model, tok = load_model(args.model, device=resolve_device(args.device))
    with status(console, f"sampling {args.n} x {args.num_generations} responses ({formats[0]} "
                        "rollout policy)"):
        batch = gradients.sample_batch(
            model, tok, formats[0], prompts=args.n, group=args.num_generations,
            max_new_tokens=args.max_new_tokens, levels=args.levels,
            temperature=args.temperature, seed=args.seed, max_sequences=args.max_sequences)
    facts = {**batch.describe(args.n, args.num_generations), "levels": args.levels,
             "max_new_tokens": args.max_new_tokens, "seed": args.seed,
             "rollout_policy": formats[0]}
    console.print(f"batch: {facts['sequences']} of {facts['responses']} responses kept "
                  f"(non-zero advantage, at most {args.max_sequences}), {facts['tokens']} "
                  f"tokens ({facts['response_tokens']} "
                  f"response tokens); mean reward {facts['reward_mean']:.3f}; advantages: "
                  f"{facts['advantages']}")
    with status(console, "differentiating") as live:
        results = gradients.diagnose_gradients(
            model, batch, formats, progress=lambda v: live.update(f"differentiating: {v}"))
    out.mkdir(parents=True, exist_ok=True)  # once there is something to put there
    for result in results:
        plots.plot_gemm_sqnr(result.layers, gradients.SCHEMES,
                             f"{args.model}, {result.format}: training GEMMs against the "
                             "unquantized GEMM of the same operands",
                             out / f"gradient_sqnr_{result.format}.png")
        console.print(_gemm_table(result), _layer_cosine_table(result), _update_table(result))
    json_path = Path(args.json) if args.json else out / "gradients.json"
    write_json(json_path, gradients.report(args.model, facts, results))
    console.print(f"plots in {out}/, data in {json_path}")
    return 0


def _gemm_table(result: FormatGradients) -> Table:
    """Per projection type, medians over layers: GEMM SQNR per scheme; zero shares of dY,
    of Q(dY) and of the non-zero dY entries flushed to zero (the requantize pass)."""
    return _kind_table(f"{result.format}: GEMM SQNR vs the unquantized GEMM of the same "
                       "operands (dB), zeros of dY and Q(dY) (median over layers)", result, {
        "Y": "gemm_sqnr/requantize/Y", "dX req": "gemm_sqnr/requantize/dX",
        "dX reuse": "gemm_sqnr/reuse_forward/dX", "dW req": "gemm_sqnr/requantize/dW",
        "dW reuse": "gemm_sqnr/reuse_forward/dW", "0s dY": "zeros/requantize/dY",
        "0s Q(dY) dX": "zeros/requantize/QdY_dX", "0s Q(dY) dW": "zeros/requantize/QdY_dW",
        "flushed dX": "zeros/requantize/flushed_dX",
        "flushed dW": "zeros/requantize/flushed_dW"})


def _layer_cosine_table(result: FormatGradients) -> Table:
    """Per projection type: median cosine of each layer's weight gradient with the
    unquantized one and with the exact gradient of the FP4 forward."""
    short = {"fp4_forward": "fwd", "requantize": "req", "reuse_forward": "reuse",
             "weights_only": "W only", "activations_only": "X only"}
    columns = {f"{short[v]} | bf16": f"grad_cosine/{v}/bf16" for v in short}
    columns.update({f"{short[v]} | fwd": f"grad_cosine/{v}/fp4_forward"
                    for v in ("requantize", "reuse_forward")})
    return _kind_table(f"{result.format}: per-layer cosine of dW, variant | reference "
                       "(fwd: fp4_forward; median over layers)", result, columns)


def _kind_table(title: str, result: FormatGradients, columns: dict[str, str]) -> Table:
    from rich.table import Table

    from fp4rl.analysis.gradients import summarize

    table = Table(title=title)
    table.add_column("layers")
    for col in columns:
        table.add_column(col, justify="right")
    for kind in ("", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                 "down_proj"):
        m = summarize(result, kind)
        table.add_row(kind.removesuffix("_proj") or "all",
                      *(f"{m[k]:.1%}" if k.startswith("zeros") else
                        f"{m[k]:.3f}" if "cosine" in k else f"{m[k]:.1f}"
                        for k in columns.values()))
    return table


def _update_table(result: FormatGradients) -> Table:
    """Per variant: cosine of the whole update with each reference, and the median
    per-layer SQNR of the weight gradients against each."""
    from rich.table import Table

    from fp4rl.analysis.gradients import REFERENCES, summarize

    table = Table(title=f"{result.format}: the update direction (all gradients "
                        "concatenated; linears: the patched layers' weights only)")
    table.add_column("variant")
    for ref in REFERENCES:
        for col in (f"cos vs {ref}", f"cos linears vs {ref}", f"median SQNR vs {ref}"):
            table.add_column(col, justify="right")
    m = summarize(result)
    for variant, cos in result.update_cosine.items():
        cells = []
        for ref in REFERENCES:
            if ref not in cos:
                cells += ["", "", ""]
                continue
            cells += [f"{cos[ref]:.3f}",
                      f"{result.linear_cosine[variant][ref]:.3f}",
                      f"{m[f'grad_sqnr/{variant}/{ref}']:.1f} dB"]
        table.add_row(variant, *cells)
    return table


def _fidelity(args: argparse.Namespace, console: Console) -> int:
    from dataclasses import asdict

    from rich.table import Table

    from fp4rl.analysis import fidelity, plots
    from fp4rl.data import synthetic_dataset
    from fp4rl.models import load_model
    from fp4rl.nn import preset
    from fp4rl.rl.datasets import encode_examples

    methods = args.methods or fidelity.default_methods()
    for m in methods:
        preset(m)  # fail fast on a bad name, before loading anything
    _check_outputs(json=args.json, plot=args.plot)
    from fp4rl.precision import resolve_device

    with status(console, f"loading {args.model}"):
        model, tok = load_model(args.model, device=resolve_device(args.device))
    examples, prompts = encode_examples(
        synthetic_dataset("test", n=args.n, levels=args.levels, seed=args.seed), tok,
        max_prompt_length=4096, log=console.print)
    with status(console, "scoring methods") as live:
        rows = fidelity.run_fidelity(
            model, tok, prompts, [e.answer for e in examples], methods,
            max_new_tokens=args.max_new_tokens,
            progress=lambda m: live.update(f"scoring {m}"))
    table = Table(title=f"rollout fidelity on {len(examples)} arithmetic prompts "
                        f"(levels {args.levels})")
    for col in ("method", "KL vs unquantized", "KL vs FP4 train", "|dlogp| vs unquantized",
                "|dlogp| vs FP4 train", "greedy acc"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.method, f"{r.kl:.4f}", f"{r.kl_vs_train:.4f}", f"{r.logprob_diff:.4f}",
                      f"{r.logprob_diff_vs_train:.4f}", f"{r.accuracy:.1%}")
    console.print(table)
    if args.json:
        write_json(args.json, {
            "model": args.model, "prompts": len(examples), "levels": list(args.levels),
            "max_new_tokens": args.max_new_tokens, "rows": [asdict(r) for r in rows]})
    if args.plot:
        plots.plot_fidelity(rows, Path(args.plot))
    return 0


def _train(args: argparse.Namespace, console: Console) -> int:
    """One run; under torchrun / accelerate every process runs this, rank 0 speaks and
    writes the run's files."""
    from fp4rl.rl.distributed import launched_rank, teardown

    if launched_rank() != 0:
        console = Console(quiet=True)
    try:
        return _train_run(args, console, is_main=launched_rank() == 0)
    finally:
        teardown()


#: the preset ``fp4rl train`` runs without ``--config``: one that runs anywhere in minutes
DEFAULT_TRAIN_PRESET = "smoke"


def _train_run(args: argparse.Namespace, console: Console, is_main: bool) -> int:
    from fp4rl.paths import check_writable
    from fp4rl.rundir_lock import exclusive

    out = Path(args.output)
    check_writable(out, "--output", directory=True)
    # a mistake is refused before the directory is touched, lock file included
    cfg = _resume_config(args, out, console) if args.resume else _new_run_config(args, out)
    created = not out.exists()
    # one writer per run directory; under torchrun the ranks share rank 0's lock
    lock = exclusive(out, warn=console.print) if is_main else contextlib.nullcontext()
    try:
        with lock:
            if not args.resume:
                _refuse_a_run(out)  # one that started between the check and the lock
            return _train_with(cfg, out, args.resume, console, is_main)
    except BaseException as err:
        if created and is_main and not _refused_by_lock(err):
            _remove_unstarted(out)
        raise


def _refused_by_lock(err: BaseException) -> bool:
    """Whether ``err`` is a second writer's refusal (the directory is the holder's)."""
    from fp4rl.errors import OutputError

    return isinstance(err, OutputError) and " is in use by " in str(err)


def _train_with(cfg: TrainConfig, out: Path, resume: bool, console: Console,
                is_main: bool) -> int:
    from fp4rl.progress import progress_bar
    from fp4rl.rl.report import write_run_report
    from fp4rl.rl.trainer import Trainer

    trainer = Trainer.from_config(cfg, out, log=console.print)
    if is_main:  # as run: device, precision, strategy; the contract of --resume
        write_text_atomic(out / CONFIG_FILE, cfg_yaml(trainer.cfg))
    cfg = trainer.cfg
    with progress_bar(console) as bar:
        task = bar.add_task("GRPO", total=cfg.run.steps, completed=0, info="")

        def show(step: int, total: int, m: dict) -> None:
            bar.update(task, completed=step, info=f"reward {m['reward_mean']:.3f}  "
                       f"loss {m['loss']:+.4f}  len {m['completions/mean_length']:.0f}")

        trainer.train(resume=resume, progress=show)
    if is_main:
        write_run_report(out)
        console.print(f"metrics: {out / 'metrics.jsonl'}  curves: {out / 'curves.png'}")
    return 0


#: a run directory's settings as run: what ``--resume`` continues, and checks against
CONFIG_FILE = "config.yaml"


def _steps(args: argparse.Namespace) -> dict[str, int]:
    return {} if args.steps is None else {"run.steps": args.steps}


def _holds_run(out: Path) -> bool:
    from fp4rl.rl import checkpoint as ckpt
    from fp4rl.rl.trainer import METRICS

    return (out / METRICS).exists() or ckpt.latest_checkpoint(out) is not None


def _new_run_config(args: argparse.Namespace, out: Path) -> TrainConfig:
    """A new run's config: ``--config`` (default :data:`DEFAULT_TRAIN_PRESET`) with the
    overrides; refused where ``out`` already holds a run."""
    from fp4rl.rl.config import load_config

    _refuse_a_run(out)
    return load_config(args.config or DEFAULT_TRAIN_PRESET, args.overrides, _steps(args))


def _refuse_a_run(out: Path) -> None:
    from fp4rl.errors import OutputError

    if _holds_run(out):
        raise OutputError(f"{out} already holds a run: pass --resume to continue it, or "
                          "choose another --output")


def _resume_config(args: argparse.Namespace, out: Path, console: Console) -> TrainConfig:
    """The run's saved config, with the overrides that cannot change its trajectory
    (:data:`fp4rl.rl.config.RESUMABLE`); any other change is refused, listing the keys.
    ``--config`` may be given again: its ``auto`` settings mean what they resolved to."""
    from fp4rl.errors import ResumeError
    from fp4rl.rl.config import RESUMABLE, changed_settings, describe_changes, load_config

    saved_path = out / CONFIG_FILE
    if not saved_path.is_file():
        raise ResumeError(f"--resume: {out} holds no run to resume (no {CONFIG_FILE}); drop "
                          "--resume to start one there")
    saved = load_config(saved_path)
    requested = _resolved_like(load_config(args.config or saved_path, args.overrides,
                                           _steps(args)), saved)
    changed = changed_settings(saved, requested)
    if changed:
        raise ResumeError(f"--resume continues {out} with its saved settings ({saved_path}) "
                          f"and would change {describe_changes(changed)}; only "
                          f"{', '.join(RESUMABLE)} may change: start a new run under another "
                          "--output to try other settings")
    _check_checkpoints(out, console)
    return requested


def _check_checkpoints(out: Path, console: Console) -> None:
    """Say when a run has no checkpoint yet (it trains from step 0), and refuse one whose
    every checkpoint is damaged before loading any model; the trainer reports a damaged
    latest one as it falls back to the previous."""
    from fp4rl.errors import CheckpointError
    from fp4rl.rl import checkpoint as ckpt

    found = ckpt.complete_checkpoints(out)
    if not found:
        console.print(f"note: {out} has no checkpoint yet: training it from step 0")
    problems = []
    for path in found:
        try:
            ckpt.verify_checkpoint(path)
            return
        except CheckpointError as err:
            problems.append(str(err))
    if problems:
        raise CheckpointError(f"--resume: no checkpoint of {out} is intact: "
                              + "; ".join(problems))


def _resolved_like(requested: TrainConfig, saved: TrainConfig) -> TrainConfig:
    """``requested`` with each ``auto`` the trainer resolves (device, mixed precision,
    strategy) taken from ``saved``, which holds what it resolved to."""
    update: dict[str, object] = {key: getattr(saved, key) for key in ("device", "mixed_precision")
                                 if getattr(requested, key) == "auto"}
    if requested.distributed.strategy == "auto":
        update["distributed"] = requested.distributed.model_copy(
            update={"strategy": saved.distributed.strategy})
    return requested.model_copy(update=update)


def _remove_unstarted(out: Path) -> None:
    """Remove the run directory a failed or interrupted command created, unless a step
    finished in it: an empty run directory only blocks the next attempt's name."""
    import shutil

    if not _holds_run(out):
        shutil.rmtree(out, ignore_errors=True)


def cfg_yaml(cfg: object) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)  # type: ignore[attr-defined]


def _eval(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.precision import resolve_device
    from fp4rl.progress import progress_bar
    from fp4rl.rl.datasets import encode_examples
    from fp4rl.rl.evaluate import evaluate
    from fp4rl.rl.sources import eval_split, load_policy

    _check_outputs(json=args.json)
    examples = eval_split(args.data, n=args.n, levels=args.levels, seed=args.seed,
                          fields=args.field)
    device = resolve_device(args.device)
    model, tok, label = load_policy(args.model, args.checkpoint, args.recipe, device)
    examples, prompts = encode_examples(examples, tok, 4096, args.template)
    with progress_bar(console) as bar:
        task = bar.add_task("eval", total=None, info=label)
        result = evaluate(model, tok, examples, prompts, k=args.mean_at, seed=args.seed,
                          temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                          batch_size=args.batch_size, mixed_precision=args.mixed_precision,
                          progress=lambda n: bar.advance(task, n))
    console.print(f"{label} on {args.data} ({result.n} prompts): "
                  f"mean@{result.k} = {result.mean:.1%}, best@{result.k} = {result.best:.1%}"
                  + (f", per level {result.per_level}" if result.per_level else ""))
    if args.json:
        write_json(args.json, {"policy": label, "data": args.data, **result.as_dict()})
    return 0


def _export(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.export import export_checkpoint, export_pretrained

    _check_outputs(output=args.output)
    source = args.checkpoint or args.model
    with status(console, f"exporting {source} as {args.format}"):
        export = export_checkpoint if args.checkpoint else export_pretrained
        result = export(source, args.format, args.output, recipe=args.recipe)
    console.print(result.summary(), markup=False, highlight=False, soft_wrap=True)
    return 0


def _cost(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.analysis.cost import cost_table, format_cost_table

    rows = cost_table(args.m, args.d, args.n, sparsities=args.sparsity,
                      fp4_speedup=args.fp4_speedup)
    console.print(f"linear layer X[{args.m}x{args.d}] W[{args.n}x{args.d}]^T, FP4 throughput "
                  f"{args.fp4_speedup:g}x FP16")
    console.print(format_cost_table(rows), markup=False)
    return 0


def track(items: object, description: str, console: Console) -> object:
    """A progress bar over ``items`` (rich)."""
    from rich.progress import track as rich_track

    return rich_track(items, description=description, console=console, transient=True)


def _experiment(args: argparse.Namespace, console: Console) -> int:
    from fp4rl import experiments as ex

    preset = ex.get_preset(args.preset)
    formats = tuple(args.formats or preset.formats)
    seeds = ex.check_seeds(args.seeds) if args.seeds is not None else preset.seeds
    exp = ex.Experiment(args.kind, preset, Path(args.output), formats, tuple(args.overrides),
                        tuple(ex.EvalSpec.parse(e) for e in args.evals or []), seeds)
    grid = ex.grid_cells(args.kind, formats)
    for cell in grid:
        ex.cell_config(exp, cell)  # fail fast on a bad override or a placeholder path
    cut = preset.grid(args.kind, formats)
    chosen = ex.select_cells(grid, args.cells) if args.cells else cut
    cells = cut + [c for c in chosen if c not in cut]  # what the report covers
    runs = ex.seeded_cells(chosen, exp.run_seeds)
    from fp4rl.rundir_lock import exclusive

    with exclusive(exp.output, warn=console.print):  # one writer per experiment directory
        return _experiment_in(args, exp, cells, chosen, runs, console)


def _experiment_in(args: argparse.Namespace, exp: Experiment, cells: list[Cell],
                   chosen: list[Cell], runs: list, console: Console) -> int:
    from fp4rl import experiments as ex

    if not args.report_only:
        console.print(f"{args.kind} grid, {exp.preset.name} preset: {len(chosen)} of {len(cells)} "
                      f"cells x seeds {', '.join(map(str, exp.run_seeds))} in {exp.output} "
                      f"({args.jobs} at a time)")
        _run_grid(exp, runs, args.jobs, console)
    results = ex.load_results(exp, cells, exp.run_seeds)
    path = ex.write_report(exp, cells, results, command=["fp4rl", *args.argv])
    console.print(path.read_text(), markup=False, soft_wrap=True)
    console.print(f"report: {path}")
    return 0


def _run_grid(exp: Experiment, runs: list[Cell], jobs: int, console: Console) -> None:
    """Run the unfinished (cell, seed) runs with a progress bar."""
    from fp4rl import experiments as ex
    from fp4rl.progress import progress_bar

    with progress_bar(console) as bar:
        grid = bar.add_task("runs", total=len(runs), info="")
        steps = bar.add_task("GRPO", total=None, info="", visible=jobs <= 1)

        def status(cell: Cell, what: str) -> None:
            if what in ("done", "finished earlier"):
                bar.advance(grid)
            if what == "running":
                bar.reset(steps)
            bar.update(grid, info=f"{cell.label}: {what}")

        def step(s: int, total: int, m: dict) -> None:
            bar.update(steps, total=total, completed=s, info=f"reward {m['reward_mean']:.3f}")

        ex.run_cells(exp, runs, jobs=jobs, on_status=status, progress=step)


def _demo(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.demo import DemoSize, run_demo

    given = {"steps": args.steps, "eval_prompts": args.eval_prompts}
    size = DemoSize(**{k: v for k, v in given.items() if v is not None})
    return run_demo(console, model=args.model, output=args.output, size=size, seed=args.seed,
                    device=args.device, mixed_precision=args.mixed_precision,
                    config=args.config, rollout_engine=args.rollout_engine)


def _env(args: argparse.Namespace, console: Console) -> int:
    from fp4rl import env

    sections = env.report()
    console.print(env.render(sections), markup=False, highlight=False, soft_wrap=True)
    if args.json:
        write_json(args.json, sections)
    return 0


def _presets(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.presets import list_presets

    presets = list_presets()
    width = max(map(len, presets))
    for name, description in presets.items():
        console.print(f"{name:<{width}}  {description}", markup=False, highlight=False,
                      soft_wrap=True)
    return 0


def _add_device_args(parser: argparse.ArgumentParser, precision: str) -> None:
    parser.add_argument("--device", default="auto",
                        help="auto (cuda when available), cpu, cuda or cuda:N")
    parser.add_argument("--mixed-precision", default=precision, choices=["no", "bf16", "auto"],
                        help=f"compute dtype: no (fp32), bf16, auto (bf16 where native); "
                        f"default {precision}")


#: fp4rl.experiments.PRESETS' names, spelled out so that building the parser imports no
#: experiment code
EXPERIMENT_PRESETS = ("tiny", "tiny3", "paper-3b", "paper-7b")


class UsageError(UserError):
    """A malformed command line, reported by :func:`main` in one line."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line (exit 2 through :func:`main`), not a usage
    block; ``--help`` still shows the usage."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a count, a size, a number of steps)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a temperature, a speed-up)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from fp4rl import __version__

    parser = _Parser(prog="fp4rl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fp4rl {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the main job on the embedded default model")
    demo.add_argument("--config", default="demo",
                      help="config preset name (see fp4rl presets) or YAML file; default demo")
    demo.add_argument("--model", help="override the config's model")
    demo.add_argument("--output", default="runs/demo", help="run directory for the report")
    demo.add_argument("--steps", type=positive_int,
                      help="GRPO steps (default: sized for ~10 min)")
    demo.add_argument("--eval-prompts", type=positive_int, help="test prompts per evaluation")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--rollout-engine", choices=[*list_engines(), *ALIASES],
                      help="where GRPO's rollouts run: hf (fp4rl's engine) or vllm (a "
                      "colocated vLLM engine with the fp4rl method); default: the config's")
    _add_device_args(demo, "auto")
    demo.set_defaults(func=_demo)

    train = sub.add_parser("train", help="GRPO with FP4 rollout and FP4 training policies")
    train.add_argument("--config", help="config preset name (see fp4rl presets) or YAML file; "
                       f"default {DEFAULT_TRAIN_PRESET} (with --resume: the run's own)")
    train.add_argument("--output", required=True, help="run directory")
    train.add_argument("--steps", type=positive_int, help="override run.steps")
    train.add_argument("--resume", action="store_true",
                       help="continue the run in --output from its latest checkpoint that "
                       "loads, with its saved settings (docs/training.md)")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. grpo.learning_rate=1e-5 (anywhere among "
                       "the options)")
    train.set_defaults(func=_train)

    presets = sub.add_parser("presets", help="the config presets --config NAME accepts")
    presets.set_defaults(func=_presets)

    ev = sub.add_parser("eval", help="Mean@1 (greedy) or Mean@k accuracy")
    src = ev.add_mutually_exclusive_group()
    src.add_argument("--model", help="registered name or checkpoint directory")
    src.add_argument("--checkpoint", help="a training run directory or one of its checkpoints")
    ev.add_argument("--recipe", help="evaluate under this rollout recipe preset (e.g. "
                    "hif4+resq-2:4); default: unquantized, or the run's recipe with "
                    "--recipe run")
    ev.add_argument("--data", default="synthetic",
                    help="synthetic (arithmetic), synthetic-words (word problems), or "
                    "LAYOUT:PATH (gsm8k, math500, aime24, aime25, amc23, "
                    "dapo-math-17k)")
    ev.add_argument("--field", action="append", metavar="ROLE=NAME",
                    help="field mapping, e.g. problem=Problem (repeatable)")
    ev.add_argument("--template", help="prompt template (boxed, gsm8k, direct; default: the "
                    "data's own): score a trained policy with the prompt it was trained on")
    ev.add_argument("--n", type=positive_int, default=100,
                    help="number of prompts (synthetic: spread over the levels; levels 1 "
                    "and 2 hold 95 and 52 test questions)")
    ev.add_argument("--levels", type=int, nargs="+", default=[1, 2], help="synthetic levels")
    ev.add_argument("--mean-at", type=positive_int, default=1,
                    help="1: greedy Mean@1; k: Mean@k")
    ev.add_argument("--temperature", type=positive_float, default=1.0)
    ev.add_argument("--max-new-tokens", type=positive_int, default=256)
    ev.add_argument("--batch-size", type=positive_int, default=32)
    ev.add_argument("--seed", type=int, default=0)
    _add_device_args(ev, "auto")
    ev.add_argument("--json", help="write the result here")
    ev.set_defaults(func=_eval)

    export = sub.add_parser("export", help="a run's policy as a directory other tools load: "
                            "bf16, compressed-tensors mxfp4/nvfp4, fp4rl's packed hif4, "
                            "or vllm (served by vLLM with the fp4rl plug-in)")
    what = export.add_mutually_exclusive_group(required=True)
    what.add_argument("--checkpoint", help="a training run directory (its latest checkpoint) "
                      "or one of its checkpoints")
    what.add_argument("--model", help="registered name or checkpoint directory (untrained)")
    export.add_argument("--format", required=True,
                        help="bf16, mxfp4, nvfp4 (compressed-tensors), hif4 (fp4rl packed) "
                        "or vllm (float32 block linears + fp4rl quantization_config)")
    export.add_argument("--recipe", help="--format vllm only: the rollout recipe vLLM runs, a "
                        "preset (default hif4+resq-2:4) or 'run' (the run's own, with "
                        "--checkpoint)")
    export.add_argument("--output", required=True, help="new (or empty) directory to write")
    export.set_defaults(func=_export)

    diag = sub.add_parser("diagnose", help="zero collapse, outlier blocks, residual sparsity")
    diag.add_argument("--model", default="smollm2-135m", help="registered name or checkpoint dir")
    diag.add_argument("--format", dest="formats", action="append",
                      help="format to diagnose (repeatable; default hif4 and mxfp4)")
    diag.add_argument("--prompts", help=".txt (one per line) or .jsonl prompt file")
    diag.add_argument("--output", "--out", dest="out", default="runs/diagnose",
                      help="directory for the plots (--out: the former name)")
    diag.add_argument("--json", help="where to write the data (default OUT/diagnose.json)")
    diag.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    diag.add_argument("--gradients", action="store_true",
                      help="diagnose the training GEMMs and the update on one GRPO batch "
                      "instead (docs/diagnostics.md)")
    diag.add_argument("--n", type=int, help="--gradients: arithmetic prompts (default 8)")
    diag.add_argument("--num-generations", type=int,
                      help="--gradients: responses per prompt (default 4)")
    diag.add_argument("--max-new-tokens", type=int,
                      help="--gradients: response length limit (default 64)")
    diag.add_argument("--temperature", type=float,
                      help="--gradients: sampling temperature (default 0.8)")
    diag.add_argument("--levels", type=int, nargs="+",
                      help="--gradients: synthetic task levels (default 1 2)")
    diag.add_argument("--seed", type=int, help="--gradients: seed of prompts and samples "
                      "(default 0)")
    diag.add_argument("--max-sequences", type=int,
                      help="--gradients: responses differentiated at most, whole groups "
                      "first (default 16; memory grows with them)")
    diag.set_defaults(func=_diagnose)

    fid = sub.add_parser("fidelity", help="how far each rollout configuration strays")
    fid.add_argument("--model", default="smollm2-135m", help="registered name or checkpoint dir")
    fid.add_argument("--methods", nargs="+", help="rows, e.g. bf16 hif4 hif4+resq-2:4 "
                     "mxfp4+occ (default: bf16 and every recovery for hif4 and mxfp4)")
    fid.add_argument("--n", type=positive_int, default=48, help="number of arithmetic prompts")
    fid.add_argument("--levels", type=int, nargs="+", default=[1, 2])
    fid.add_argument("--seed", type=int, default=0)
    fid.add_argument("--max-new-tokens", type=positive_int, default=48)
    fid.add_argument("--json", help="write the rows to this JSON file")
    fid.add_argument("--plot", help="write a bar chart PNG here")
    fid.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    fid.set_defaults(func=_fidelity)

    cost = sub.add_parser("cost", help="effective FLOPs of FP4 and Rollout-ResQ GEMMs")
    cost.add_argument("--m", type=positive_int, default=4096, help="tokens")
    cost.add_argument("--d", type=positive_int, default=4096, help="in_features")
    cost.add_argument("--n", type=positive_int, default=4096, help="out_features")
    cost.add_argument("--sparsity", nargs="+", default=["dense", "2:4"],
                      help="ResQ patterns to cost (dense, 2:4, channel:0.5, ...)")
    cost.add_argument("--fp4-speedup", type=positive_float, default=4.0,
                      help="FP4 GEMM throughput relative to FP16")
    cost.set_defaults(func=_cost)

    exp = sub.add_parser("experiment", help="the paper's Table 1 (precision) or Tables 2/4 "
                         "(recovery) grid: a GRPO run + evaluation per cell, resumable")
    exp.add_argument("kind", choices=["precision", "recovery"])
    exp.add_argument("--preset", default="tiny", choices=EXPERIMENT_PRESETS,
                     help="tiny: smollm2-135m + synthetic arithmetic on a CPU, one seed; "
                     "tiny3: smollm2-135m + synthetic word problems, 5 seeds, 300 test "
                     "prompts; paper-*: the paper's Qwen runs (local weights and data via "
                     "--set)")
    exp.add_argument("--output", required=True, help="directory for the cells and the report "
                     "(rerun the same command to resume)")
    exp.add_argument("--format", dest="formats", action="append",
                     help="FP4 format (repeatable; default: the preset's)")
    exp.add_argument("--set", dest="overrides", action="append", default=[],
                     metavar="key=value", help="config override for every cell, e.g. "
                     "model=/models/Qwen2.5-3B (repeatable)")
    exp.add_argument("--eval", dest="evals", action="append", metavar="NAME=LAYOUT:PATH",
                     help="benchmark column (repeatable; default: the preset's test split)")
    exp.add_argument("--jobs", type=positive_int, default=1, help="cells run in parallel "
                     "(each gets cpu_count/jobs torch threads)")
    exp.add_argument("--cells", nargs="+", metavar="NAME",
                     help="run only these cells (preset names such as hif4+resq-2:4 or "
                     "mxfp4:bf16/fp4); the report still covers the whole grid")
    exp.add_argument("--seeds", type=int, nargs="+", metavar="SEED",
                     help="run every cell once per seed (default: the preset's; tiny and "
                     "paper-*: the config's run.seed only), with intervals over seeds and "
                     "prompts in the report; run.seed keeps <output>/cells, seed S goes to "
                     "<output>/seed-S/cells")
    exp.add_argument("--report-only", action="store_true",
                     help="write the tables from the finished runs without running any")
    exp.set_defaults(func=_experiment)

    envp = sub.add_parser("env", help="versions, devices and kernels, for a bug report")
    envp.add_argument("--json", help="also write the report to this JSON file")
    envp.set_defaults(func=_env)

    bench = sub.add_parser("bench", help="speed benchmarks (ratios measured side by side)")
    bench.add_argument("what", choices=["formats", "linear", "rollout", "train", "engine"],
                       help="engine: the vLLM rollout engine's memory, refit bytes and "
                       "speed, bf16 against the fp4rl method's two weight storages")
    bench.add_argument("--model", default="smollm2-135m", help="model for rollout / train")
    bench.add_argument("--json", help="also write the results to this JSON file")
    bench.add_argument("--format", dest="formats", action="append",
                       help="limit to this format (repeatable)")
    bench.add_argument("--size", type=positive_int, default=4096,
                       help="square tensor side (formats)")
    bench.add_argument("--device", default="cpu", help="cpu, or cuda (formats: the Triton "
                       "kernels)")
    bench.add_argument("--dim", type=int, default=-1, choices=[0, 1, -1],
                       help="formats: the axis to quantize along")
    bench.add_argument("--tokens", type=positive_int, help="linear: tokens per linear "
                       "(default 512); rollout: new tokens per prompt (default 32)")
    bench.add_argument("--engine", nargs="+", default=["hf"], choices=[*list_engines(), *ALIASES],
                       help="rollout: fp4rl's engine (hf), vLLM with the fp4rl plug-in "
                       "(vllm), or both, measured side by side (default hf); train: vllm "
                       "compares the FP4 step with its rollout in vLLM against fp4rl's engine")
    bench.add_argument("--batch", type=positive_int, help="rollout: prompts per run "
                       "(default 8, or 32 with --engine vllm)")
    bench.add_argument("--shapes", type=positive_int, help="only the first N linear shapes")
    bench.add_argument("--repeats", type=positive_int, default=5)
    bench.set_defaults(func=_bench)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line as a namespace; ``train``'s overrides may stand anywhere among
    its options (argparse takes only the first run of positionals)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":
        args.overrides += [a for a in extra if not a.startswith("-")]
        extra = [a for a in extra if a.startswith("-")]
    if extra:
        raise UsageError(f"fp4rl {args.command}", f"unrecognized arguments: {' '.join(extra)}")
    args.argv = argv
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command. Whatever a user can cause (a value, a path, a file's contents, a
    damaged checkpoint) is one line on stderr and exit status 2; Ctrl-C is one line and
    130. ``--debug`` shows the traceback instead; a bug always does."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    args = None
    try:
        args = parse([a for a in argv if a != "--debug"])
        return args.func(args, Console())
    except (UserError, OSError) as err:
        if debug:
            raise
        _say(err.prog if isinstance(err, UsageError) else _prog(args), _message(err))
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        _say(_prog(args), _interrupted(args))
        return 130


def _prog(args: argparse.Namespace | None) -> str:
    return "fp4rl" if args is None else f"fp4rl {args.command}"


def _say(prog: str, message: str) -> None:
    """One line on stderr, whatever the message holds, naming the command."""
    print(f"{prog}: {' '.join(message.split())}", file=sys.stderr)


def _message(err: Exception) -> str:
    """A user error's message, or an operating-system error (a full disk, a file that
    vanished, a permission) as the file and what went wrong."""
    if isinstance(err, UsageError):
        return f"error: {err} (see {err.prog} --help)"
    if isinstance(err, OSError) and err.strerror:
        where = f"{err.filename}: " if err.filename else ""
        return f"error: {where}{err.strerror}"
    return f"error: {err}"


def _interrupted(args: argparse.Namespace | None) -> str:
    """What an interrupted command leaves: for training, the checkpoint it resumes from."""
    if args is None or args.command != "train":
        return "interrupted" + (": rerun the same command to resume" if args is not None
                                and args.command == "experiment" else "")
    from fp4rl.rl import checkpoint as ckpt

    found = ckpt.latest_checkpoint(Path(args.output))
    if found is None:
        return f"interrupted before the first checkpoint of {args.output}: nothing to resume"
    return (f"interrupted; {found} is the latest checkpoint: continue with fp4rl train "
            f"--output {args.output} --resume")


if __name__ == "__main__":
    sys.exit(main())
