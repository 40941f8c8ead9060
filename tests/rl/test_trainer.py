"""The GRPO trainer on a tiny model: one step, metrics, checkpoints, kill-and-resume, the
optimizer and examples chosen outside."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from fp4rl.models import tiny_model
from fp4rl.rl import checkpoint as ckpt
from fp4rl.rl.config import ConfigError, load_config
from fp4rl.rl.rundir import METRICS, read_metrics
from fp4rl.rl.trainer import Trainer

OVERRIDES = [
    "train.weights=hif4", "train.activations=hif4", "train.gradients=hif4",
    "rollout.weights=hif4", "rollout.activations=hif4", "rollout.recovery.method=resq",
    "grpo.num_generations=4", "grpo.batch_size=2", "grpo.micro_batch_size=4",
    "grpo.max_response_length=6", "grpo.learning_rate=1e-3", "data.train_size=12",
    "data.reward=has_digit", "run.save_steps=2",
]
TIMING = ("time/", "tokens_per_second/")

DRIVER = textwrap.dedent("""
    import os, signal, sys
    import torch
    from fp4rl.models import tiny_model
    from fp4rl.rl import checkpoint, rewards
    from fp4rl.rl.config import load_config
    from fp4rl.rl.trainer import Trainer

    torch.set_num_threads(1)
    out, kill_at, how, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
    rewards.register_reward("has_digit", lambda c, r: float(any(ch.isdigit() for ch in c)),
                            replace=True)
    cfg = load_config(None, sys.argv[5:])
    model, tok = tiny_model("llama")
    trainer = Trainer(cfg, out, model, tok, log=lambda m: None)

    if how == "save":  # die inside the checkpoint write, after the model file
        real = checkpoint._fsync_tree
        def dying(path):
            if trainer.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            real(path)
        checkpoint._fsync_tree = dying

    def progress(step, total, metrics):
        if how == "step" and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    trainer.train(resume=resume, progress=progress)
""")


def run_driver(tmp_path, out, kill_at, how, resume, steps):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    args = [sys.executable, str(script), str(out), str(kill_at), how, "1" if resume else "0",
            *OVERRIDES, f"run.steps={steps}"]
    return subprocess.run(args, capture_output=True, text=True, timeout=600)


def without_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def test_one_step_writes_metrics_and_checkpoint(tmp_path):
    from fp4rl.rl import rewards

    rewards.register_reward("parity", lambda c, r: float(len(c) % 2), replace=True)  # mixed
    model, tok = tiny_model("qwen2")
    cfg = load_config(None, [*OVERRIDES, "run.steps=2", "data.reward=parity"])
    before = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    history = Trainer(cfg, tmp_path, model, tok, log=lambda m: None).train()
    rows = read_metrics(tmp_path / METRICS)
    assert [r["step"] for r in rows] == [1, 2] and rows == history
    for key in ("reward_mean", "loss", "sampling/sampling_logp_difference/mean",
                "mismatch/token_mult_prob_error", "mismatch/gen_kl_error",
                "sampling/importance_sampling_ratio/mean", "clip_ratio/region_mean",
                "completions/mean_length", "tokens_per_second/rollout",
                "tokens_per_second/train", "frac_reward_zero_std", "entropy"):
        assert key in rows[0], key
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000002"
    assert any(r["active_fraction"] > 0 for r in rows)  # parity of lengths: mixed groups
    assert not torch.equal(before, model.model.layers[0].mlp.down_proj.weight)


@pytest.mark.parametrize("how,kill_at", [("step", 3), ("save", 4)])
def test_kill_and_resume_reproduces_uninterrupted_run(tmp_path, how, kill_at):
    steps = 5
    straight = run_driver(tmp_path, tmp_path / "a", 0, "none", False, steps)
    assert straight.returncode == 0, straight.stderr
    killed = run_driver(tmp_path, tmp_path / "b", kill_at, how, False, steps)
    assert killed.returncode == -9, killed.stderr  # SIGKILL
    partial = read_metrics(tmp_path / "b" / METRICS)
    assert len(partial) == kill_at
    resumed = run_driver(tmp_path, tmp_path / "b", 0, "none", True, steps)
    assert resumed.returncode == 0, resumed.stderr
    a = read_metrics(tmp_path / "a" / METRICS)
    b = read_metrics(tmp_path / "b" / METRICS)
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    assert without_timing(a) == without_timing(b)
    assert any(r["active_fraction"] > 0 for r in a), "the run never updated the policy"


def test_interrupted_save_never_becomes_latest(tmp_path):
    model, _ = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {"step": 1})
    # a half-written later checkpoint (no completion marker) and a stale temp dir
    (tmp_path / "checkpoints" / "step-000002").mkdir()
    (tmp_path / "checkpoints" / ".step-000003.abc").mkdir()
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000001"
    (tmp_path / "checkpoints" / "latest").write_text("step-000002")
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000001"


@pytest.mark.slow
def test_smoke_config_trains_the_embedded_model(tmp_path):
    """The smoke preset: two GRPO steps of smollm2-135m, both policies in HiF4, that earn
    reward and update (almost) every projection weight. Which sampled responses are right
    differs between CPUs (bf16 bits do), so the test asserts what holds on any of them with
    overwhelming probability: the run earns reward (a step misses with probability ~0.5%,
    both ~2e-5, see the preset) and at least one step updates."""
    from safetensors.torch import load_file

    from fp4rl.cli import main
    from fp4rl.models import load_model

    out = tmp_path / "smoke"
    assert main(["train", "--config", "smoke", "--output", str(out),
                 "run.keep_checkpoints=1"]) == 0
    rows = read_metrics(out / METRICS)
    assert [r["step"] for r in rows] == [1, 2]
    assert any(r["reward_mean"] > 0 and r["active_fraction"] > 0 for r in rows)
    assert all(r["completions/mean_length"] > 0 for r in rows)
    # the FP4 rollout (HiF4 + ResQ-2:4) and the FP4 training policy disagree a little
    assert 0 < rows[0]["sampling/sampling_logp_difference/mean"] < 1.0
    assert ckpt.latest_checkpoint(out).name == "step-000002"
    assert (out / "curves.png").is_file()
    base = load_model("smollm2-135m")[0].state_dict()
    trained = load_file(ckpt.latest_checkpoint(out) / "model.safetensors")
    projections = [name for name in trained if name.endswith("proj.weight")]
    changed = sum(int((trained[n] != base[n]).sum()) for n in projections)
    assert changed >= 0.99 * sum(trained[n].numel() for n in projections)


def test_cli_train_then_resume_keeps_history(tmp_path, tiny_llama_dir, capsys):
    from fp4rl.cli import main
    from fp4rl.rl import rewards

    rewards.register_reward("has_digit", lambda c, r: float(any(ch.isdigit() for ch in c)),
                            replace=True)
    out = tmp_path / "run"
    args = ["train", "--output", str(out), f"model={tiny_llama_dir}", *OVERRIDES]
    assert main([*args, "--steps", "2"]) == 0
    assert main([*args, "--steps", "3"]) == 2  # a second run into the same directory
    assert main([*args, "--steps", "3", "--resume"]) == 0
    assert [r["step"] for r in read_metrics(out / METRICS)] == [1, 2, 3]
    assert (out / "config.yaml").is_file() and (out / "curves.png").is_file()
    said = " ".join(capsys.readouterr().out.split())  # the run's mismatch against the limits
    assert "mismatch over the run: token_mult_prob_error" in said and "NeMo-RL's < 1.15" in said


def test_several_updates_per_rollout_batch(tmp_path):
    """Two PPO epochs over two mini-batches: four optimizer steps, ratios leave 1."""
    from fp4rl.rl import rewards

    rewards.register_reward("has_digit", lambda c, r: float(any(ch.isdigit() for ch in c)),
                            replace=True)
    model, tok = tiny_model("llama")
    cfg = load_config(None, [*OVERRIDES, "run.steps=3", "grpo.ppo_epochs=2",
                             "grpo.mini_batch_size=1", "grpo.loss_agg_mode=token-mean",
                             "grpo.beta=0.1"])
    trainer = Trainer(cfg, tmp_path, model, tok, log=lambda m: None)
    rows = trainer.train()
    assert all("kl" in r for r in rows if r["active_fraction"] > 0)
    assert trainer.optimizer.state and max(
        s["step"].item() for s in trainer.optimizer.state.values()) == 4 * 3


@pytest.mark.parametrize("tokens", ["all", "trained"])
def test_on_policy_update_takes_old_logprobs_from_its_own_forward(tmp_path, tokens):
    """One epoch, one optimizer step: no separate old-log-prob pass over the rows that
    train (the model runs one forward per micro-batch of them, plus, for NeMo-RL's
    metrics over every token, one no-grad forward per micro-batch of the rows that do
    not); the rollout-mismatch metrics equal an independent no-grad pass, taken on the
    batch the step hands its update, before the update: ``mismatch/*`` over every token
    (or the rows that train, ``grpo.mismatch_tokens=trained``), ``mismatch/trained/*``
    over the rows that train."""
    from fp4rl.nn import train_mode
    from fp4rl.rl import rewards
    from fp4rl.rl.grpo import mismatch_stats
    from fp4rl.rl.logprobs import response_logprobs

    # mixed rewards on prompts with an odd answer, none on the others (rows that don't train)
    rewards.register_reward("odd_parity", lambda c, r: float(len(c) % 2) * (int(r[-1]) % 2),
                            replace=True)
    model, tok = tiny_model("llama")
    cfg = load_config(None, [*OVERRIDES, "data.reward=odd_parity", "grpo.batch_size=4",
                             f"grpo.mismatch_tokens={tokens}"])
    trainer = Trainer(cfg, tmp_path, model, tok, log=lambda m: None)
    seen: dict[str, object] = {}
    update = trainer.update

    def spy(batch, advantages):
        trains = advantages != 0
        ids, attention = batch.sequences()
        with torch.no_grad(), train_mode(model), trainer.compute():  # the run's dtype
            old, _ = response_logprobs(model, ids, attention, ids.shape[1] -
                                       batch.response_ids.shape[1])
        every = batch.response_mask.bool()
        trained = every & trains[:, None]
        cap = cfg.grpo.tis_imp_ratio_cap
        seen["trains"] = trains
        seen["expected"] = mismatch_stats(old, batch.logprobs,
                                          every if tokens == "all" else trained, cap)
        seen["expected_trained"] = mismatch_stats(old, batch.logprobs, trained, cap)
        forwards = []
        hook = model.register_forward_hook(lambda *_: forwards.append(1))
        try:
            result = update(batch, advantages)
        finally:
            hook.remove()
        seen["forwards"], seen["stats"] = len(forwards), result.stats
        micro = cfg.grpo.micro_batch_size
        seen["micro_batches"] = -(-int(trains.sum()) // micro) + \
            (-(-int((~trains).sum()) // micro) if tokens == "all" else 0)
        return result

    trainer.update = spy
    trainer.train_step()
    trains = seen["trains"]
    assert 0 < trains.sum() < len(trains), "the check needs rows that train and rows that not"
    assert seen["forwards"] == seen["micro_batches"]  # no pass of its own for trained rows
    for key, value in seen["expected"].items():
        assert seen["stats"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for key, value in seen["expected_trained"].items():
        if key.startswith("mismatch/"):
            trained_key = key.replace("mismatch/", "mismatch/trained/")
            assert seen["stats"][trained_key] == pytest.approx(value, rel=1e-4, abs=1e-6)
    assert seen["stats"]["clip_ratio/region_mean"] == 0  # ratio exactly 1


def test_optimizer_and_examples_are_chosen_outside(tmp_path):
    """The optimizer comes by torch.optim name with kwargs from the config, or ready-made;
    examples may be handed in; timings are their own record."""
    from fp4rl.data import Example
    from fp4rl.rl import rewards
    from fp4rl.rl.optim import build_optimizer

    rewards.register_reward("has_digit", lambda c, r: float(any(ch.isdigit() for ch in c)),
                            replace=True)
    # a KL term trains every row, whatever the rewards: the update then sees tokens
    cfg = load_config(None, [*OVERRIDES, "run.steps=1", "optimizer.name=sgd",
                             "optimizer.kwargs={momentum: 0.5}", "grpo.beta=0.01"])
    model, tok = tiny_model("llama")
    examples = [Example(f"What is {i} + 1?", str(i + 1), "has_digit", source="test", index=i)
                for i in range(4)]
    trainer = Trainer(cfg, tmp_path, model, tok, examples=examples, log=lambda m: None)
    assert type(trainer.optimizer) is torch.optim.SGD
    assert trainer.optimizer.param_groups[0]["momentum"] == 0.5
    assert len(trainer.train_examples) == 4
    metrics = trainer.train_step()
    assert trainer.last_timings.rollout > 0 and trainer.last_timings.train_tokens > 0
    assert metrics["time/rollout"] == trainer.last_timings.rollout
    assert not [k for k in metrics if k.startswith("_")]
    adam = build_optimizer(model.parameters(), load_config(None, []))
    assert type(adam) is torch.optim.AdamW
    with pytest.raises(ConfigError, match=r"'adamm' is not a torch.optim optimizer \(did you"):
        build_optimizer(model.parameters(), load_config(None, ["optimizer.name=adamm"]))
    with pytest.raises(ConfigError, match="optimizer SGD"):
        build_optimizer(model.parameters(), load_config(
            None, ["optimizer.name=SGD", "optimizer.kwargs={nesterov_typo: true}"]))


