"""Does GRPO with its rollouts in vLLM learn as with fp4rl's own engine?

Runs ``fp4rl demo`` with each rollout engine at several seeds (the same seed draws the same
prompts and the same held-out set for both engines, so the runs pair by seed), keeps each
run's ``outcome.json`` under ``--output`` (a finished run is not run again: the grid
resumes run by run), and prints, per engine and for vLLM minus hf, the change of every
score the demo measures with a seed-level Student-t interval widened by the prompt
sampling (:func:`fp4rl.experiments.stats.seed_t`).

Run it from the vLLM environment (``make test-vllm`` builds ``.venv-vllm``)::

    .venv-vllm/bin/python benchmarks/engine_comparison.py --seeds 0 1 2 \\
        --steps 20 --eval-prompts 100 --output benchmarks/results/engines
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fp4rl.experiments.stats import Estimate, seed_t
from fp4rl.precision import describe_cpu

ENGINES = ("hf", "vllm")
#: the demo's scores: key in outcome.json, label, scale (points or reward)
SCORES = (("fp4", "FP4 rollout policy, greedy accuracy (points)", 100.0),
          ("fp4_sampled", "FP4 rollout policy, held-out reward", 1.0),
          ("bf16", "bf16 view of the FP32 masters, greedy accuracy (points)", 100.0),
          ("fp4_words", "word problems it did not train on (points)", 100.0))


def run_one(engine: str, seed: int, steps: int, prompts: int, output: Path
            ) -> dict[str, Any]:
    """One demo run's outcome (run now unless its outcome.json exists)."""
    out = output / f"{engine}-seed{seed}"
    done = out / "outcome.json"
    if not done.is_file():
        cmd = [sys.executable, "-m", "fp4rl.cli", "demo", "--rollout-engine", engine,
               "--seed", str(seed), "--steps", str(steps), "--eval-prompts", str(prompts),
               "--output", str(out)]
        print("running:", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True)
    outcome: dict[str, Any] = json.loads(done.read_text())
    return outcome


def changes(outcome: dict[str, Any], key: str) -> npt.NDArray[np.float64]:
    """Per held-out prompt: after minus before (share of correct samples)."""
    before, after = outcome["before"][key], outcome["after"][key]
    if before["prompts"] != after["prompts"]:
        raise SystemExit(f"{key}: before and after were scored on different prompts")
    k = _k(after)  # samples per prompt
    return (np.asarray(after["correct"], dtype=np.float64)
            - np.asarray(before["correct"], dtype=np.float64)) / k


def _k(result: dict[str, Any]) -> int:
    return int(next(key for key in result if key.startswith("mean@")).split("@")[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/engines"))
    args = parser.parse_args()
    print(describe_cpu(), flush=True)
    runs = {(e, s): run_one(e, s, args.steps, args.eval_prompts, args.output)
            for s in args.seeds for e in ENGINES}
    #: per score: its label and the scaled estimates of hf, vllm and vllm - hf
    rows: list[tuple[str, dict[str, Estimate]]] = []
    for key, label, scale in SCORES:
        per = {e: np.stack([changes(runs[e, s], key) for s in args.seeds]) for e in ENGINES}
        est = {e: seed_t(per[e]) for e in ENGINES}
        diff = seed_t(per["vllm"] - per["hf"])
        rows.append((label, {**{e: est[e].scaled(scale) for e in ENGINES},
                             "vllm_minus_hf": diff.scaled(scale)}))
        cells = [f"{est[e].scaled(scale).mean:+.3g} [{est[e].scaled(scale).lo:+.3g}, "
                 f"{est[e].scaled(scale).hi:+.3g}]" for e in ENGINES]
        d = diff.scaled(scale)
        print(f"{label}: hf {cells[0]}; vllm {cells[1]}; vllm - hf {d.mean:+.3g} "
              f"[{d.lo:+.3g}, {d.hi:+.3g}]")
    minutes = {e: [runs[e, s]["minutes"] for s in args.seeds] for e in ENGINES}
    table = ["| change over the run (seed-t 95% interval) | fp4rl's engine (hf) | vLLM | "
             "vLLM - hf |", "| --- | --- | --- | --- |"]
    for label, row in rows:
        table.append(f"| {label} | " + " | ".join(
            f"{row[k].mean:+.3g} [{row[k].lo:+.3g}, {row[k].hi:+.3g}]"
            for k in (*ENGINES, "vllm_minus_hf")) + " |")
    (args.output / "summary.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    summary = {"cpu": describe_cpu(), "seeds": args.seeds, "steps": args.steps,
               "eval_prompts": args.eval_prompts, "minutes": minutes,
               "rows": [{"score": label, **{k: asdict(e) for k, e in row.items()}}
                        for label, row in rows]}
    (args.output / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.output / 'summary.json'}")


if __name__ == "__main__":
    main()
