"""``rollout.engine=vllm`` under torchrun: one vLLM engine in each process (vLLM's external
launcher joins the run's process group), each rolling out its share of the step's rows
under the same per-row seeds as one process, refit from DDP's replicas or, under FSDP2,
from the 4-bit codes and scales the ranks all-gather."""

from __future__ import annotations

import json

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from _launch import launcher, run_bounded  # noqa: E402

#: a quarter of the smoke preset's step (16 rows: one rollout chunk per rank), and a KV
#: cache two engines share on a small machine
ARGS = ["train", "--config", "smoke", "--steps", "2", "rollout.engine=vllm",
        "grpo.batch_size=4", "grpo.micro_batch_size=8", "run.keep_checkpoints=1",
        "rollout.vllm.kv_cache_bytes=268435456"]
TIMEOUT_S = 480


def _train(output, nproc: int, *extra: str) -> list[dict]:
    """``fp4rl train`` on ``nproc`` processes, killed as a group on a timeout; the run's
    metrics lines."""
    run = run_bounded([*launcher(nproc), "-m", "fp4rl", *ARGS, "--output", str(output),
                       *extra], TIMEOUT_S, nproc)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]  # engines stop before the group
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.long
def test_two_processes_with_an_engine_each_equal_one_process(tmp_path):
    one = _train(tmp_path / "one", 1)
    assert [r["step"] for r in one] == [1, 2]
    for strategy in ("ddp", "fsdp"):
        two = _train(tmp_path / strategy, 2, f"distributed.strategy={strategy}")
        assert [r["step"] for r in two] == [1, 2]
        for a, b in zip(one, two, strict=True):
            assert b["reward_mean"] == a["reward_mean"], strategy
            assert b["completions/mean_length"] == a["completions/mean_length"], strategy
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7), strategy
            assert b["time/refit"] > 0
        if strategy == "fsdp":  # HiF4 rollout weights cross ranks as 4.5 bits per value
            for line in two:
                assert line["sync/rollout_weight_bytes_4bit"] == pytest.approx(
                    line["sync/rollout_weight_bytes_as_bf16"] * 4.5 / 16)
