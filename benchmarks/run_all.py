"""Run every ``fp4rl bench`` benchmark and keep its JSON result under benchmarks/results/."""

from __future__ import annotations

import sys
from pathlib import Path

from fp4rl.cli import main

BENCHMARKS = ("formats", "linear", "rollout", "train")


def run_all(out_dir: Path) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in BENCHMARKS:
        status = main(["bench", name, "--json", str(out_dir / f"{name}.json")])
        if status:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(run_all(Path(__file__).with_name("results")))
