"""``FP4GRPOTrainer(use_vllm=True, vllm_mode="colocate")`` on 2 processes under
``accelerate launch`` (gloo on this CPU): one colocated vLLM engine per process, each
running the fp4rl method and refit from its own replica of the weights before every
generation round.

What holds against one process: DDP keeps the replicas equal, so every engine holds the
same ``Q(W)``, bit for bit, the grid one process's engine would hold for those weights.
What does not: TRL seeds each rank's engine with its rank and vLLM draws per engine, not
per request, so the completions (and every metric computed from them) are another
sample of the same policy than one process draws."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs these "
                    "tests in an environment of its own")
pytest.importorskip("trl", reason="TRL is not installed: pip install \"trl>=1.16,<1.17\"")

from _launch import run_bounded

HERE = Path(__file__).parent


def test_two_processes_each_roll_out_in_their_own_fp4_engine(tmp_path):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", "29533",
           str(HERE / "_trl_rank.py"), str(tmp_path)]
    path = os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    run = run_bounded(cmd, timeout_s=900, nproc=2, PYTHONPATH=path)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in ranks:
        assert report["world_size"] == 2
        assert report["methods"] == ["FP4RLLinearMethod"] and report["engine_layers"] > 0
        assert len(report["refits"]) == 2
        assert all(r["time/refit"] > 0 and r["sync/bytes"] > 0 for r in report["refits"])
        assert all(math.isfinite(v) for v in report["is_metrics"].values())
    assert ranks[0]["weight_digest"] == ranks[1]["weight_digest"]  # DDP replicas
    assert ranks[0]["engine_digest"] == ranks[1]["engine_digest"]  # the same Q(W)
