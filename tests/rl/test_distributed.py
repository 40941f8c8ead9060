"""Training on several processes (torch.distributed, gloo on this CPU).

The multi-process tests launch 2 processes with torchrun, each run bounded in time and
its whole process group killed on a timeout, so no process outlives a test."""

from __future__ import annotations

import subprocess
import textwrap

import pytest
import torch
from _launch import launcher, run_bounded
from _paths import FIXTURES

from fp4rl.errors import ConfigError
from fp4rl.rl.distributed import Dist, reduce_metrics, setup
from fp4rl.rl.rundir import METRICS, read_metrics

DRIVER = textwrap.dedent("""
    import os, signal, sys
    from fp4rl.cli import main
    from fp4rl.rl import rewards
    from fp4rl.rl.trainer import Trainer

    # a reward with signal on a random tiny model: the parity of the response's length
    rewards.register_reward("parity", lambda completion, reference: float(len(completion) % 2),
                            replace=True)
    kill = os.environ.get("KILL_RANK1_AFTER_STEP")
    if kill and os.environ.get("RANK") == "1":  # rank 1 dies after that step's checkpoint
        real = Trainer.save
        def save_then_die(self, *args, **kwargs):
            path = real(self, *args, **kwargs)
            if self.step == int(kill):
                os.kill(os.getpid(), signal.SIGKILL)
            return path
        Trainer.save = save_then_die
    sys.exit(main(sys.argv[1:]))
""")
TIMEOUT_S = 240


#: a config of the library defaults, not the smoke preset `fp4rl train` runs without one
DEFAULTS = FIXTURES / "defaults.yaml"


def _overrides(model_dir, precision: str = "no") -> list[str]:
    return ["--config", str(DEFAULTS), f"model={model_dir}", f"mixed_precision={precision}",
            "device=cpu",
            "train.weights=hif4", "train.activations=hif4", "train.gradients=hif4",
            "rollout.weights=hif4", "rollout.activations=hif4", "rollout.recovery.method=resq",
            "data.reward=parity", "data.train_size=16", "grpo.batch_size=4",
            "grpo.num_generations=4", "grpo.mini_batch_size=2", "grpo.micro_batch_size=3",
            "grpo.max_response_length=8", "grpo.learning_rate=1e-3", "grpo.temperature=1.0",
            "run.steps=2", "run.save_steps=1"]


def _run(args: list[str], tmp_path, nproc: int, driver: str = DRIVER, **env_vars: str
         ) -> subprocess.CompletedProcess:
    """``driver`` on ``nproc`` processes (torchrun for 2), killed as a group on timeout."""
    script = tmp_path / "driver.py"
    script.write_text(driver)
    return run_bounded([*launcher(nproc), str(script), *args], TIMEOUT_S, nproc, **env_vars)


def test_the_batch_must_divide_by_the_processes():
    Dist(1, 2).check_divides(8)
    Dist().check_divides(3)
    with pytest.raises(ConfigError, match=r"grpo.batch_size \(5\) does not divide by the 2"):
        Dist(0, 2).check_divides(5)


def test_one_process_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    d, device = setup("auto", "auto", "cpu", 10)
    assert (d.strategy, d.world_size, device.type) == ("none", 1, "cpu")
    assert reduce_metrics({"loss": 1.0}, d) == {"loss": 1.0}
    with pytest.raises(ConfigError, match="needs several processes: launch with 'torchrun"):
        setup("ddp", "auto", "cpu", 10)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="backend=nccl needs CUDA"):
        setup("ddp", "nccl", "cpu", 10)
    with pytest.raises(ConfigError, match="strategy=none"):
        setup("none", "auto", "cpu", 10)


def test_bad_distributed_input_is_one_line(tmp_path, tiny_llama_dir):
    run = _run(["train", "--output", str(tmp_path / "x"), *_overrides(tiny_llama_dir),
                "distributed.strategy=ddp"], tmp_path, 1)
    assert run.returncode == 2
    assert "needs several processes" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize(("strategy", "precision"), [("ddp", "no"), ("ddp", "bf16"),
                                                      ("fsdp", "bf16")])
def test_two_processes_equal_one_process(tmp_path, tiny_llama_dir, strategy, precision):
    """Same rollouts (per-sample seeds, the same rollout chunks), same rewards, the same
    optimizer steps (two mini-batches per step, micro-batches that do not divide evenly
    over the ranks): every micro-batch is computed as one process computes it, so the
    losses agree far inside the 1e-3 asked for."""
    args = _overrides(tiny_llama_dir, precision)
    single = _run(["train", "--output", str(tmp_path / "one"), *args], tmp_path, 1)
    assert single.returncode == 0, single.stderr[-3000:]
    double = _run(["train", "--output", str(tmp_path / "two"), *args,
                   f"distributed.strategy={strategy}"], tmp_path, 2)
    assert double.returncode == 0, double.stderr[-3000:]
    one, two = read_metrics(tmp_path / "one" / METRICS), read_metrics(tmp_path / "two" / METRICS)
    assert [r["step"] for r in two] == [1, 2]  # written once, by rank 0
    assert any(r["active_fraction"] > 0 for r in one)  # the steps did learn something
    for a, b in zip(one, two, strict=True):
        assert a["active_fraction"] == b["active_fraction"]
        assert a["reward_mean"] == b["reward_mean"]
        assert a["completions/mean_length"] == b["completions/mean_length"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-9)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5, abs=1e-9)
    w1 = torch.load(tmp_path / "one" / "checkpoints" / "step-000002" / "state.pt",
                    weights_only=False)["step"]
    assert w1 == 2
    saved = (tmp_path / "two" / "config.yaml").read_text()
    assert f"strategy: {strategy}" in saved
    if strategy == "fsdp":
        _check_sharded_checkpoints(tmp_path / "one", tmp_path / "two", tiny_llama_dir)
        for line in two:  # HiF4 rollout weights travel as 4.5 bits per value, not 16
            assert line["sync/rollout_weight_bytes_4bit"] == pytest.approx(
                line["sync/rollout_weight_bytes_as_bf16"] * 4.5 / 16)


def _check_sharded_checkpoints(single, sharded, model_dir) -> None:
    """FSDP checkpoints hold shards (dcp/); the last one also a consolidated HF file, which
    equals the shards reassembled on one process, and both agree with one process's run."""
    from safetensors.torch import load_file

    from fp4rl.models import load_model
    from fp4rl.rl import checkpoint as ckpt

    for step in (1, 2):
        path = ckpt.step_dir(sharded, step)
        assert ckpt.has_shards(path) and (path / "state-rank1.pt").is_file()
        assert (path / "model.safetensors").is_file() == (step == 2)  # consolidated at the end
        model, _ = load_model(str(model_dir))
        state = ckpt.restore_checkpoint(path, model) if step == 1 else None
        if step == 2:  # force the shards path, then compare with the consolidated file
            ckpt.load_weights(path, model)
            shards_only = path.parent / "shards-only"
            shards_only.mkdir()
            (shards_only / "dcp").symlink_to(path / "dcp")
            again, _ = load_model(str(model_dir))
            ckpt.load_weights(shards_only, again)
            for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(),
                                    strict=True):
                assert torch.equal(a, b), name
        else:
            assert state["step"] == 1
        reference = load_file(ckpt.step_dir(single, step) / "model.safetensors")
        mine = model.state_dict()
        for name, value in reference.items():
            torch.testing.assert_close(mine[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_after_a_rank_dies_equals_the_uninterrupted_run(tmp_path, tiny_llama_dir,
                                                                strategy):
    """Rank 1 is SIGKILLed after step 2's checkpoint; the launcher ends the run; a rerun
    with --resume on two processes continues from step 2 and writes the metrics the
    uninterrupted run wrote (under FSDP each rank reloads its own model and optimizer
    shards from the torch.distributed.checkpoint directory)."""
    args = [*_overrides(tiny_llama_dir), "run.steps=3", f"distributed.strategy={strategy}"]
    straight = _run(["train", "--output", str(tmp_path / "a"), *args], tmp_path, 2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _run(["train", "--output", str(tmp_path / "b"), *args], tmp_path, 2,
                  KILL_RANK1_AFTER_STEP="2")
    assert killed.returncode != 0
    assert [r["step"] for r in read_metrics(tmp_path / "b" / METRICS)] == [1, 2]
    resumed = _run(["train", "--output", str(tmp_path / "b"), "--resume", *args], tmp_path, 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    timing = ("time/", "tokens_per_second/")
    strip = [{k: v for k, v in r.items() if not k.startswith(timing)}
             for r in read_metrics(tmp_path / "a" / METRICS)]
    again = [{k: v for k, v in r.items() if not k.startswith(timing)}
             for r in read_metrics(tmp_path / "b" / METRICS)]
    assert again == strip


PACKED_SYNC = textwrap.dedent("""
    import copy, gc, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from fp4rl.gemm import quantize_operand
    from fp4rl.models import tiny_model
    from fp4rl.nn import FP4Linear, fp4_layers, quantize_model
    from fp4rl.nn.recipe import get_recipe
    from fp4rl.rollout.weight_sync import sync_rollout_weights

    def main(name: str) -> None:
        recipe = get_recipe(name)
        torch.manual_seed(0)
        llama, _ = tiny_model("llama")
        odd = torch.nn.Linear(128, 33)  # 33 rows: shards of 17 and 16, one padded
        with torch.no_grad():
            odd.weight[-1, 0] = 50.0  # the amax on rank 1's shard (NVFP4's tensor scale)
        model = torch.nn.ModuleDict({"llama": llama, "odd": odd})
        quantize_model(llama, recipe)
        model["odd"] = FP4Linear.from_linear(odd, recipe)
        expected = {n: quantize_operand(m.weight.detach(), m.recipe.rollout.weights, -1)
                    for n, m in fp4_layers(model).items()}
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        policy = copy.deepcopy(model)
        with torch.no_grad():  # whatever the copy holds must come from the sync
            for p in policy.parameters():
                p.zero_()
        mesh = init_device_mesh("cpu", (2,))
        for block in llama.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(llama, mesh=mesh)
        fully_shard(model["odd"], mesh=mesh)
        sent = sync_rollout_weights(model, policy, 2)
        for name, layer in fp4_layers(policy).items():
            got, want = layer.rollout_weight(), expected[name]
            assert torch.equal(got.values, want.values), name
            assert (got.scale is None) == (want.scale is None), name
            assert got.scale is None or torch.equal(got.scale, want.scale), name
            assert not layer.weight.any(), name  # no FP32 weight travelled for it
        packed = {f"{n}.weight" for n in fp4_layers(policy)}
        for name, p in policy.named_parameters():
            if name not in packed:
                assert torch.equal(p, full[name]), name
        assert 0 < sent.packed < sent.packed_as_bf16 / 3
        print("packed sync ok", sent)

    # The sharded modules hold the group: they die with main's frame (and the collection),
    # so gloo's worker threads are joined now, not during interpreter shutdown.
    dist.init_process_group("gloo")
    try:
        main(sys.argv[1])
    finally:
        gc.collect()
        dist.destroy_process_group()
""")


@pytest.mark.parametrize("recipe", ["hif4+resq-2:4", "mxfp4", "nvfp4+resq-2:4"])
def test_packed_rollout_weights_decode_to_the_single_process_weights(tmp_path, recipe):
    """Each rank encodes its shard of every rollout weight in the 4-bit format, the ranks
    all-gather the codes and scales, and the decoded weights equal one process's rollout
    quantization bit for bit (uneven shards and NVFP4's per-tensor scale included)."""
    run = _run([recipe], tmp_path, 2, driver=PACKED_SYNC)
    assert run.returncode == 0, run.stdout[-1000:] + run.stderr[-3000:]
    assert "packed sync ok" in run.stdout
