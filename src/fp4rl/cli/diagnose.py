"""``fp4rl diagnose``: zero collapse, outlier blocks and residual sparsity of the
activations, or (``--gradients``) the training GEMMs and the update on one GRPO batch, or
(``--sensitivity``) how far float noise moves each recipe's log-probs."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from fp4rl.cli.options import (
    add_device_option,
    check_outputs,
    int_at_least,
    positive_float,
    positive_int,
    track,
)
from fp4rl.errors import UserError
from fp4rl.paths import write_json
from fp4rl.progress import status

#: ``fp4rl diagnose`` options of the gradient diagnosis, and their defaults
GRADIENT_OPTIONS = {"n": 8, "num_generations": 4, "max_new_tokens": 64, "temperature": 0.8,
                    "seed": 0, "levels": [1, 2], "max_sequences": 16}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``diagnose`` command's options."""
    diag = sub.add_parser("diagnose", help="zero collapse, outlier blocks, residual sparsity")
    diag.add_argument("--model", default="smollm2-135m", help="registered name or checkpoint dir")
    diag.add_argument("--format", dest="formats", action="append",
                      help="format to diagnose (repeatable; default hif4 and mxfp4)")
    diag.add_argument("--prompts", help=".txt (one per line) or .jsonl prompt file")
    diag.add_argument("--output", "--out", dest="out", default="runs/diagnose",
                      help="directory for the plots (--out: the former name)")
    diag.add_argument("--json", help="where to write the data (default OUT/diagnose.json)")
    add_device_option(diag)
    diag.add_argument("--gradients", action="store_true",
                      help="diagnose the training GEMMs and the update on one GRPO batch "
                      "instead (docs/diagnostics.md)")
    diag.add_argument("--sensitivity", action="store_true",
                      help="per recipe, how far a 1e-7 nudge of the input embeddings moves "
                      "the rollout policy's log-probs (float noise a recipe amplifies; "
                      "docs/diagnostics.md)")
    diag.add_argument("--recipe", dest="recipes", action="append",
                      help="--sensitivity: a recipe, NAME or NAME@pow2|static for its NVFP4 "
                      "activations' scale (repeatable; default a set covering each kind)")
    diag.add_argument("--nudge", type=positive_float,
                      help="--sensitivity: the relative nudge (default 1e-7)")
    diag.add_argument("--n", type=positive_int, help="--gradients: arithmetic prompts (default 8)")
    diag.add_argument("--num-generations", type=int_at_least(2),
                      help="--gradients: responses per prompt (default 4)")
    diag.add_argument("--max-new-tokens", type=positive_int,
                      help="--gradients: response length limit (default 64)")
    diag.add_argument("--temperature", type=positive_float,
                      help="--gradients: sampling temperature (default 0.8)")
    diag.add_argument("--levels", type=int, nargs="+",
                      help="--gradients: synthetic task levels (default 1 2)")
    diag.add_argument("--seed", type=int, help="--gradients: seed of prompts and samples "
                      "(default 0)")
    diag.add_argument("--max-sequences", type=positive_int,
                      help="--gradients: responses differentiated at most, whole groups "
                      "first (default 16; memory grows with them)")
    diag.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:

    _check_diagnose_args(args)
    check_outputs(output=args.out, json=args.json)
    if args.gradients:
        return _diagnose_gradients(args, console)
    if args.sensitivity:
        return _diagnose_sensitivity(args, console)
    from fp4rl.analysis import diagnose, plots, tables
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
    table = tables.activation_table(layers, formats)
    console.print(table)
    json_path = Path(args.json) if args.json else out / "diagnose.json"
    write_json(json_path, diagnose.report(args.model, formats, layers))
    console.print(f"plots in {out}/, data in {json_path}")
    return 0


def _check_diagnose_args(args: argparse.Namespace) -> None:
    """Each of the two diagnoses takes only its own options; fill in the defaults."""

    given = [k for k in GRADIENT_OPTIONS if getattr(args, k) is not None]
    if args.gradients and args.sensitivity:
        raise UserError("--gradients and --sensitivity are two diagnoses: choose one")
    if not args.sensitivity and (args.recipes or args.nudge is not None):
        raise UserError("only with --sensitivity: --recipe, --nudge")
    if args.sensitivity and args.formats:
        raise UserError("--sensitivity takes recipes (--recipe NAME), not --format")
    if args.sensitivity:
        from fp4rl.analysis.sensitivity import parse_recipe

        for spec in args.recipes or []:
            parse_recipe(spec)  # an unknown recipe or rule: one line, before loading
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
    """Refuse, in one line, levels the synthetic task does not have (argparse checks the
    counts and the temperature)."""
    from fp4rl.data.synthetic import LEVELS

    if not args.levels or set(args.levels) - set(LEVELS):
        raise UserError(f"--levels: choose among {sorted(LEVELS)}")


def _diagnose_sensitivity(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from fp4rl.analysis import sensitivity
    from fp4rl.analysis.prompts import encode_prompts, load_prompts
    from fp4rl.models import load_model
    from fp4rl.precision import resolve_device

    nudge = args.nudge if args.nudge is not None else 1e-7
    specs = args.recipes or list(sensitivity.DEFAULT_RECIPES)
    with status(console, f"loading {args.model}"):
        model, tok = load_model(args.model, device=resolve_device(args.device))
    prompts = encode_prompts(tok, load_prompts(args.prompts))
    rows = [sensitivity.sensitivity(model, prompts, spec, nudge)
            for spec in track(specs, "scoring each recipe twice", console)]
    table = Table(title=f"{args.model}: log-prob change under a {nudge:g} nudge of the "
                        f"input embeddings ({rows[0].tokens} prompt tokens, rollout policy, "
                        "fp32)")
    for col in ("recipe", "mean nat", "max nat", "tokens moved"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.recipe, f"{r.mean_nat:.3g}", f"{r.max_nat:.3g}",
                      f"{100 * r.changed_fraction:.1f}%")
    console.print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else out / "sensitivity.json"
    write_json(json_path, sensitivity.report(args.model, nudge, rows))
    console.print(f"data in {json_path}")
    return 0


def _diagnose_gradients(args: argparse.Namespace, console: Console) -> int:
    from fp4rl.analysis import gradients, plots, tables
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
        console.print(tables.gemm_table(result), tables.layer_cosine_table(result),
                      tables.update_table(result))
    json_path = Path(args.json) if args.json else out / "gradients.json"
    write_json(json_path, gradients.report(args.model, facts, results))
    console.print(f"plots in {out}/, data in {json_path}")
    return 0
