"""GRPO with the rollout in vLLM (``rollout.engine: vllm``) on the embedded model."""

from __future__ import annotations

import gc
import json
import shutil

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from fp4rl.cli import main  # noqa: E402


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
    for r in rows:
        assert r["time/refit"] > 0 and r["sync/bytes"] > 0  # refit before every rollout
        assert r["completions/mean_length"] > 0
    trained = [r for r in rows if r["active_fraction"] > 0]
    assert trained, "the smoke preset earns reward within two steps"
    for r in trained:  # mu from vLLM, pi_old from the trainer: the mismatch TIS corrects
        assert r["sampling/sampling_logp_difference/mean"] > 0
        assert 0 < r["sampling/importance_sampling_ratio/min"] <= 5.0


@pytest.mark.parametrize("overrides, says", [
    (["rollout.recovery={method: smoothquant}"], "cannot run inside vLLM"),
    (["rollout.recovery={method: resqw, sparsity: '2:4'}"], "cannot run inside vLLM"),
    (["rollout.engine=vlm"], "rollout.engine must be one of hf, vllm"),
])
def test_what_vllm_cannot_run_is_one_line(tmp_path, capsys, overrides, says):
    assert main(["train", "--config", "smoke", "--output", str(tmp_path / "x"),
                 "rollout.engine=vllm", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_resume_reproduces_the_uninterrupted_vllm_run(tmp_path):
    """The engine is rebuilt on resume and refit from the checkpoint's weights; vLLM's
    per-request seeds then draw the same tokens, so step 2 is the same step."""
    base = ["--config", "smoke", "rollout.engine=vllm", "run.save_steps=1",
            "run.keep_checkpoints=1"]
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
