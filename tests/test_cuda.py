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


def _same_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    both = torch.isnan(a.float()) & torch.isnan(b.float())
    return a.dtype == b.dtype and torch.equal(torch.where(both, 0, a.float()),
                                              torch.where(both, 0, b.float()))


@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_operands_selected_from_triton_equal_the_reference(fmt, monkeypatch):
    """The ops a GPU rollout runs, on CUDA tensors: bf16 activations to bf16 block values
    (NVFP4's scale kept on the device), ResQ's two terms, and the packed decode."""
    from fp4rl.gemm import pack_operand, quantize_operand
    from fp4rl.kernels import kernel_plan, resq_terms
    from fp4rl.recovery import sparsify

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "c" not in kernel_plan(fp4rl.get_format(fmt), "cuda").values()
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(33, 192, generator=g) * 4).bfloat16()
    f = fp4rl.get_format(fmt)
    op = quantize_operand(x.cuda(), fmt)
    scale = f.tensor_scale(x)
    opts = {} if scale is None else {"per_tensor_scale": False}
    want = f.quantize_reference(x.float() if scale is None else x.float() / scale, **opts)
    assert _same_or_both_nan(op.values.cpu(), want.bfloat16())
    if fmt != "nvfp4":
        terms = resq_terms(f, x.cuda(), 2, 4)
        q = f.quantize_reference(x.float())
        assert terms is not None and _same_or_both_nan(terms[0].cpu(), q.bfloat16())
        assert _same_or_both_nan(terms[1].cpu(),
                                 sparsify(f.quantize_reference(x.float() - q), "2:4").bfloat16())
    if fmt != "mxfp8_e4m3":
        w = torch.randn(40, 192, generator=g)
        packed = pack_operand(w.cuda(), fmt)
        want = f.decode(pack_operand(w, fmt).packed)
        assert _same_or_both_nan(packed.decode(torch.float32).values.cpu(), want)


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
