"""GRPO with the rollout in vLLM (``rollout.engine: vllm``) on the embedded model."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from fp4rl.cli import main  # noqa: E402
from fp4rl.models import load_model  # noqa: E402

#: a quarter of the smoke preset's step, for tests that compare two runs (equal metrics
#: hold whether or not a step earns reward)
SMALLER = ["grpo.batch_size=4", "grpo.micro_batch_size=8"]


@pytest.mark.slow
def test_train_rolls_out_in_vllm_refits_every_step_and_logs_the_mismatch(tmp_path, capsys):
    out = tmp_path / "run"
    # micro-batches of four sequences: the step's 64 rows are 4 rollout chunks, sampled in
    # one engine call and handed back chunk by chunk
    assert main(["train", "--config", "smoke", "--output", str(out), "--steps", "2",
                 "rollout.engine=vllm", "grpo.micro_batch_size=4",
                 "run.keep_checkpoints=1"]) == 0
    gc.collect()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # the engine computes in the run's dtype (auto: bf16 where this CPU does it natively,
    # else fp32), and the tensors other than Q(W) travel in it: the packed grid keeps the
    # refit under half the model's bytes in that dtype (0.43x in bf16, 0.32x in fp32)
    from fp4rl.precision import compute_dtype, resolve_mixed_precision

    itemsize = compute_dtype(resolve_mixed_precision("auto", torch.device("cpu"))).itemsize
    engine_bytes = sum(itemsize * p.numel() for p in load_model("smollm2-135m")[0].parameters())
    for r in rows:
        assert r["time/refit"] > 0 and r["sync/bytes"] > 0  # refit before every rollout
        assert r["sync/bytes"] <= 0.5 * engine_bytes  # the packed Q(W) on the wire
        assert r["completions/mean_length"] > 0
    trained = [r for r in rows if r["active_fraction"] > 0]
    assert trained, "the smoke preset earns reward within two steps"
    for r in trained:  # mu from vLLM, pi_old from the trainer: the mismatch TIS corrects
        assert r["sampling/sampling_logp_difference/mean"] > 0
        assert 0 < r["sampling/importance_sampling_ratio/min"] <= 5.0


@pytest.mark.parametrize("overrides, says", [
    (["rollout.recovery={method: smoothquant}"], "cannot run inside vLLM"),
    (["rollout.recovery={method: resqw, sparsity: '2:4'}"], "cannot run inside vLLM"),
    (["rollout.engine=vlm"],
     "unknown rollout engine 'vlm' (did you mean 'vllm'?); choose one of: hf, vllm"),
])
def test_what_vllm_cannot_run_is_one_line(tmp_path, capsys, overrides, says):
    assert main(["train", "--config", "smoke", "--output", str(tmp_path / "x"),
                 "rollout.engine=vllm", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


@pytest.mark.long
def test_resume_reproduces_the_uninterrupted_vllm_run(tmp_path):
    """The engine is rebuilt on resume and refit from the checkpoint's weights; vLLM's
    per-request seeds then draw the same tokens, so step 2 is the same step."""
    base = ["--config", "smoke", "rollout.engine=vllm", "run.save_steps=1",
            "run.keep_checkpoints=1", *SMALLER]
    assert main(["train", "--output", str(tmp_path / "a"), "--steps", "2", *base]) == 0
    gc.collect()
    shutil.rmtree(tmp_path / "a" / "checkpoints")  # only its metrics are compared
    assert main(["train", "--output", str(tmp_path / "b"), "--steps", "1", *base]) == 0
    gc.collect()
    assert main(["train", "--output", str(tmp_path / "b"), "--steps", "2", "--resume"]) == 0
    gc.collect()
    a, b = ([json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text()
             .splitlines()] for run in ("a", "b"))
    for key in ("reward_mean", "completions/mean_length", "loss", "grad_norm"):
        assert a[1][key] == pytest.approx(b[1][key], rel=1e-5, abs=1e-7), key


@pytest.mark.long
def test_the_engine_core_in_its_own_process_gives_the_same_run(tmp_path):
    """vLLM's default on GPUs runs the engine core in a process of its own; the refit goes
    through vLLM's worker interface, so the run is the same as with the core in the
    trainer's process: every metric but the timings."""
    runs = {}
    for multi in ("0", "1"):
        out = tmp_path / f"mp{multi}"
        done = subprocess.run(
            [sys.executable, "-m", "fp4rl.cli", "train", "--config", "smoke", "--output",
             str(out), "--steps", "2", "rollout.engine=vllm", "run.keep_checkpoints=1",
             *SMALLER],
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multi},
            capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[multi] = [json.loads(line) for line in (out / "metrics.jsonl").read_text()
                       .splitlines()]
    timing = ("time/", "tokens_per_second/")
    for a, b in zip(runs["0"], runs["1"], strict=True):
        same = {k: v for k, v in a.items() if not k.startswith(timing)}
        assert same == {k: v for k, v in b.items() if not k.startswith(timing)}
