"""One gloo rank of verl's engine in a process of its own, as the actor tests run it.

:data:`PREAMBLE` starts each child script: verl's CPU platform (``_cpu_platform``), a
one-rank gloo process group, and the import verl's ``external_lib`` makes in every worker.
The child prints its findings as one ``RESULT <json>`` line, which :func:`run_one_rank`
returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from fp4rl.nn.recipe import get_recipe
from fp4rl.rollout.vllm.host import RECIPE_ENV, encode_recipe

PREAMBLE = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import _cpu_platform
_cpu_platform.install()
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0,
                        world_size=1)
import fp4rl.integrations.verl  # what verl's external_lib import does in each worker
"""


def run_one_rank(script: str, port: int, cwd: Path) -> dict[str, Any]:
    """Run ``PREAMBLE + script`` with verl's CUDA engine selected (its platform is the CPU
    one) and the actor's recipe (the paper's) set as the documented command's ``ray_kwargs``
    set it in each worker; return the child's ``RESULT`` mapping; the child's stderr where
    it fails."""
    env = {**os.environ, "VERL_ENGINE_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "",
           RECIPE_ENV: encode_recipe(get_recipe("hif4+resq-2:4"))}
    run = subprocess.run([sys.executable, "-c", PREAMBLE + script,
                          str(Path(__file__).parent), str(port)], env=env,
                         capture_output=True, text=True, timeout=600, cwd=cwd)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[0].removeprefix("RESULT "))
