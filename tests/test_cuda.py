"""CUDA validation: the Triton quantizers bit-exact on the GPU, and a GRPO step on CUDA
equal to the CPU's within a stated tolerance. Skipped where no CUDA GPU is present."""

from __future__ import annotations

import random

import pytest
import torch

import fp4rl
from fp4rl.models import tiny_model
from fp4rl.rl import rewards
from fp4rl.rl.config import load_config
from fp4rl.rl.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FORMATS = ["hif4", "mxfp4", "nvfp4", "mxfp8_e4m3"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_quantizers_bit_exact_on_gpu(fmt, dim, dtype, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(257, 320, generator=g)
    x[torch.rand(x.shape, generator=g) < 0.01] *= 500
    x = x.to(dtype)
    got = fp4rl.quantize(x.cuda(), fmt, dim=dim).cpu()
    want = fp4rl.get_format(fmt).quantize_reference(x, dim=dim)
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def _one_step(device: str, tmp_path, precision: str) -> dict:
    # top_k=1 makes sampling device-independent; the reward is a fixed 0/1 stream, so
    # both runs train on the same advantages
    rng = random.Random(0)
    rewards.register_reward("coin_flips", lambda c, r: float(rng.random() < 0.5),
                            replace=True)
    model, tok = tiny_model("llama", seed=0)
    cfg = load_config(None, [
        f"device={device}", f"mixed_precision={precision}", "train.weights=hif4",
        "train.activations=hif4", "train.gradients=hif4", "rollout.weights=hif4",
        "rollout.activations=hif4", "rollout.recovery.method=resq", "grpo.top_k=1",
        "grpo.num_generations=4", "grpo.batch_size=2", "grpo.max_response_length=6",
        "grpo.learning_rate=1e-3", "data.train_size=8", "data.reward=coin_flips",
        "run.steps=1"])
    return Trainer(cfg, tmp_path / device, model, tok, log=lambda m: None).train()[0]


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_grpo_step_on_cuda_matches_cpu(tmp_path, precision):
    """Rewards and lengths equal exactly; loss and mismatch statistics within 2e-2
    (GEMM summation order differs between the devices, and a value on a rounding
    boundary of the 4-bit grid may round the other way)."""
    cpu = _one_step("cpu", tmp_path, precision)
    gpu = _one_step("cuda", tmp_path, precision)
    for key in ("reward_mean", "reward_std", "completions/mean_length"):
        assert gpu[key] == cpu[key], key
    for key in ("loss", "sampling/sampling_logp_difference/mean", "entropy"):
        assert gpu[key] == pytest.approx(cpu[key], rel=2e-2, abs=2e-2), key
