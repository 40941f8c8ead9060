"""verl 0.9.1's own engine builds the actor with the hook that
``actor_rollout_ref.model.external_lib=fp4rl.integrations.verl`` installs.

In a process of its own (one gloo rank): verl's ``EngineRegistry.new`` picks
``FSDPEngineWithLMHead`` (verl registers it for CUDA and NPU; ``VERL_ENGINE_DEVICE=cuda``
asks for it here), and its ``initialize()`` builds the Hugging Face model
(``_build_module``, wrapped by the hook), wraps it in FSDP2 with verl's mixed precision,
loads the state dict and builds the optimizer. The actor's linears are then fp4rl's FP4
layers on FP32 parameters, and a backward reaches every master. The reference policy
(``forward_only``) stays as verl builds it, and verl's default bf16 parameters are refused
in one line. verl's platform is the CPU one of ``_cpu_platform``, the only stand-in."""

from __future__ import annotations

import pytest

pytest.importorskip("verl.trainer", reason="verl is not installed; `make test-verl` runs "
                    "these tests in an environment of its own")

from _one_rank import run_one_rank

SCRIPT = r"""
from fp4rl.errors import UserError
from fp4rl.integrations.vllm import model_dir
from fp4rl.nn import fp4_layers
from verl.trainer.config.config import CheckpointConfig
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
from verl.workers.engine import EngineRegistry

model = HFModelConfig(path=model_dir("smollm2-135m"),
                      override_config={"attn_implementation": "sdpa"})

def engine(**config):
    engine_config = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, **config)
    return EngineRegistry.new(model_type="language_model", backend="fsdp2",
                              model_config=model, engine_config=engine_config,
                              optimizer_config=FSDPOptimizerConfig(lr=1e-6,
                                                                   total_training_steps=2),
                              checkpoint_config=CheckpointConfig())

out = {}
actor = engine(mixed_precision={"param_dtype": "fp32"})
actor.initialize()
layers = fp4_layers(actor.module)
out["engine"] = type(actor).__name__
out["module"] = type(actor.module).__name__
out["fp4_layers"] = len(layers)
out["modes"] = sorted({m.mode.name for m in layers.values()})
out["formats"] = sorted({str(m.recipe.train.weights) for m in layers.values()})
out["param_dtypes"] = sorted({str(p.dtype) for p in actor.module.parameters()})
ids = torch.randint(0, 1000, (2, 8))
actor.module(input_ids=ids, labels=ids).loss.backward()
grads = [m.weight.grad for m in layers.values()]
out["grads"] = all(g is not None and g.dtype == torch.float32 for g in grads)
reference = engine(mixed_precision={"param_dtype": "bf16"}, forward_only=True)
out["reference_fp4_layers"] = len(fp4_layers(reference._build_module()))
try:
    engine()._build_module()  # verl's default: bf16 parameters in FSDP
    out["bf16_refused"] = ""
except UserError as err:
    out["bf16_refused"] = str(err)
try:  # verl's default strategy, FSDP1
    fsdp1 = FSDPEngineConfig(strategy="fsdp", use_torch_compile=False,
                             mixed_precision={"param_dtype": "fp32"})
    EngineRegistry.new(model_type="language_model", backend="fsdp", model_config=model,
                       engine_config=fsdp1, optimizer_config=FSDPOptimizerConfig(
                           lr=1e-6, total_training_steps=2),
                       checkpoint_config=CheckpointConfig())._build_module()
    out["fsdp1_refused"] = ""
except UserError as err:
    out["fsdp1_refused"] = str(err)
print("RESULT " + json.dumps(out))
dist.destroy_process_group()
"""


def test_verls_own_engine_builds_an_fp4_actor_on_fp32_masters(tmp_path):
    out = run_one_rank(SCRIPT, 29517, tmp_path)
    assert out["engine"] == "FSDPEngineWithLMHead"
    assert out["module"].startswith("FSDP")  # verl's FSDP2 wrapped the patched model
    assert out["fp4_layers"] == 30 * 7  # every linear of SmolLM2's 30 blocks
    assert out["modes"] == ["TRAIN"] and out["formats"] == ["hif4"]
    assert out["param_dtypes"] == ["torch.float32"]
    assert out["grads"]
    assert out["reference_fp4_layers"] == 0
    assert "param_dtype=fp32" in out["bf16_refused"] and "\n" not in out["bf16_refused"]
    assert "strategy=fsdp2" in out["fsdp1_refused"] and "\n" not in out["fsdp1_refused"]
