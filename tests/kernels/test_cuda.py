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

FORMATS = ["hif4", "mxfp4", "nvfp4", "nvfp4_per_token", "mxfp8_e4m3"]


@pytest.mark.parametrize("fmt", [*FORMATS, "nvfp4_4o6", "nvfp4_per_token_4o6", "nvfp4_2d"])
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
    op = quantize_operand(x.cuda(), fp4rl.get_format(fmt))
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
        packed = pack_operand(w.cuda(), fp4rl.get_format(fmt))
        want = f.decode(pack_operand(w, fp4rl.get_format(fmt)).packed)
        assert _same_or_both_nan(packed.decode(torch.float32).values.cpu(), want)


TOKENS = (1, 2, 16, 248, 4096)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_op_bit_exact_on_gpu_at_every_token_count(fmt, monkeypatch):
    """Quantize along either axis (float32, bf16, fp16, stochastic), bf16 rows to their
    block values, and ResQ (dense and 2:4, fused and as two terms), on the GPU, equal the
    reference at token counts that Triton would specialize differently (1, 16, the rest)."""
    from fp4rl.kernels import resq_rows, resq_terms
    from fp4rl.recovery import sparsify

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    f = fp4rl.get_format(fmt)
    for n in TOKENS:
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, 192, generator=g) * torch.exp(torch.randn(n, 192, generator=g))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            xd = x.to(dtype)
            for dim in (0, 1):
                got = fp4rl.quantize(xd.cuda(), fmt, dim=dim).cpu()
                assert _same_or_both_nan(got, f.quantize_reference(xd, dim=dim)), (n, dtype)
        for dim in (0, 1):
            got = fp4rl.quantize(x.cuda(), fmt, dim=dim, rounding="stochastic",
                                 generator=torch.Generator("cuda").manual_seed(3)).cpu()
            want = f.quantize_reference(x.cuda(), dim=dim, rounding="stochastic",
                                        generator=torch.Generator("cuda").manual_seed(3)).cpu()
            assert _same_or_both_nan(got, want), (n, dim)
        if fmt == "nvfp4":
            continue
        q = f.quantize_reference(x)
        for keep, group, pattern in ((0, 0, None), (2, 4, "2:4")):
            res = f.quantize_reference(x - q)
            res = res if pattern is None else sparsify(res, pattern)
            fused = resq_rows(f, x.cuda(), keep, group)
            assert fused is not None and _same_or_both_nan(fused.cpu(), q + res), (n, group)
            terms = resq_terms(f, x.bfloat16().cuda(), keep, group)
            qb = f.quantize_reference(x.bfloat16().float())
            rb = f.quantize_reference(x.bfloat16().float() - qb)
            rb = rb if pattern is None else sparsify(rb, pattern)
            assert terms is not None and _same_or_both_nan(terms[0].cpu(), qb.bfloat16())
            assert _same_or_both_nan(terms[1].cpu(), rb.bfloat16()), (n, group)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rollout_ops_capture_in_a_cuda_graph_at_sizes_never_run(fmt, monkeypatch):
    """What vLLM does: warm an op once, then capture CUDA graphs at batch sizes it never
    ran eagerly. A kernel compiled for a new size would fail inside the capture."""
    from fp4rl.gemm import quantize_operand
    from fp4rl.kernels import resq_terms

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    f = fp4rl.get_format(fmt)

    def ops(x):
        out = [quantize_operand(x, fp4rl.get_format(fmt)).values]
        if fmt != "nvfp4":
            out += list(resq_terms(f, x, 2, 4))
        return out

    ops(torch.randn(7, 256, device="cuda").bfloat16())  # the one eager warm-up
    torch.cuda.synchronize()
    for n in TOKENS:
        x = torch.randn(n, 256, device="cuda").bfloat16()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ops(x)
        x.copy_(torch.randn(n, 256, device="cuda").bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, ops(x), strict=True):
            assert _same_or_both_nan(got, want), (n, fmt)


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


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4", "nvfp4", "nvfp4_per_token"])
def test_the_fused_packed_gemm_on_the_gpu(fmt, monkeypatch):
    """The packed GEMM compiled and run: on exact sums (quarter-integer weights, small
    integer activations) its outputs are the decode-then-GEMM's bit for bit at every
    tile height (a prefill's 128 rows too), one and two terms, with scales and a bias, K
    split at one token (two parts of 320, their sums added by the reduction); a CUDA graph
    captured at a size never run eagerly replays it."""
    from fp4rl.gemm import Operand, fuses_packed, mm, mm_packed, pack_operand

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(11)
    w = torch.randint(-12, 13, (200, 320), generator=g).float() * 0.25
    p = pack_operand(w.cuda(), fp4rl.get_format(fmt))
    bias = torch.randn(200, generator=g).bfloat16().cuda()
    from fp4rl.kernels.triton_packed_mm import k_split

    assert k_split(1, 200, 320, 1) < 320  # the split path runs at one token
    for m in (1, 5, 16, 17, 64, 65, 130, 300):
        a = torch.randint(-8, 9, (2 * m, 320), generator=g).bfloat16().cuda()
        s = torch.rand(m, 1, generator=g).cuda() + 0.5
        for ops in ([Operand(a[:m])], [Operand(a[:m], s), Operand(a[m:])]):
            assert fuses_packed(ops, p, torch.bfloat16)
            got = mm_packed(ops, p, torch.bfloat16, bias)
            want = mm(ops, p.decode(torch.bfloat16).t(), torch.bfloat16, bias)
            assert _same_or_both_nan(got, want), (m, len(ops))
    x = torch.randint(-8, 9, (3, 320), device="cuda").bfloat16()
    mm_packed(Operand(x), p, torch.bfloat16)  # the eager warm-up
    torch.cuda.synchronize()
    x9 = torch.randint(-8, 9, (9, 320), device="cuda").bfloat16()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mm_packed(Operand(x9), p, torch.bfloat16)
    x9.copy_(torch.randint(-8, 9, (9, 320), device="cuda").bfloat16())
    graph.replay()
    assert _same_or_both_nan(captured, mm(Operand(x9), p.decode(torch.bfloat16).t(),
                                          torch.bfloat16))


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
def test_resqs_n_m_residual_on_the_gpu(fmt, monkeypatch):
    """ResQ's residual kept n:m sparse, compiled and run: expanded it is the dense term
    (outside NaN blocks), and the packed GEMM on it gives the bits of the same GEMM on the
    dense terms at every tile height and with a split of K."""
    from fp4rl.gemm import NMOperand, Operand, PackedCall, pack_operand, packed_gemm
    from fp4rl.kernels import resq_terms, resq_terms_nm

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    f = fp4rl.get_format(fmt)
    g = torch.Generator().manual_seed(12)
    p = PackedCall.of(pack_operand(torch.randn(200, 320, generator=g).cuda(), f))
    bias = torch.randn(200, generator=g).bfloat16().cuda()
    for m in (1, 16, 17, 300):
        x = torch.randn(m, 320, generator=g).bfloat16().cuda()
        for keep, group in ((2, 4), (1, 2), (4, 8)):
            dense = resq_terms(f, x, keep, group)
            nm = resq_terms_nm(f, x, keep, group)
            assert dense is not None and nm is not None
            r = NMOperand(nm[1], nm[2], keep, group, 320)
            assert torch.equal(nm[0].view(torch.int16), dense[0].view(torch.int16))
            assert torch.equal(r.dense().view(torch.int16), dense[1].view(torch.int16))
            got = packed_gemm([Operand(nm[0]), r], p, torch.bfloat16, bias)
            want = packed_gemm([Operand(dense[0]), Operand(dense[1])], p, torch.bfloat16, bias)
            assert _same_or_both_nan(got, want), (m, keep, group)


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4", "nvfp4", "mxfp8_e4m3"])
def test_the_two_axis_quantizer_on_the_gpu(fmt, monkeypatch):
    """Both axes from one read, compiled and run: each output bit for bit the single-axis
    kernel's, float32 and bf16 in, float32 and bf16 out."""
    from fp4rl.gemm import quantize_operand, quantize_operand_pair

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(12)
    for shape in ((257, 320), (64, 1000), (3, 64)):
        x = torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))
        for dtype, out in ((torch.float32, None), (torch.float32, torch.bfloat16),
                           (torch.bfloat16, None)):
            xd = x.to(dtype).cuda()
            rows, cols = quantize_operand_pair(xd, fp4rl.get_format(fmt), out)
            for got, axis in ((rows, -1), (cols, 0)):
                want = quantize_operand(xd, fp4rl.get_format(fmt), axis, out_dtype=out)
                assert _same_or_both_nan(got.values.float().cpu(), want.values.float().cpu())


@pytest.mark.parametrize("recipe", ["hif4", "mxfp4", "nvfp4", "nvfp4_per_token"])
def test_the_quantize_on_load_linear_on_the_gpu(recipe, monkeypatch):
    """An FP4Linear's output and three gradients under CUDA autocast, FP32 masters, on
    exact-sum data (small integers times powers of two): the quantize-on-load GEMMs
    (fp4rl::qmm, compiled) give the quantize-first path's bits, and are the ones run."""
    from fp4rl.kernels import triton_qmm
    from fp4rl.nn import FP4Linear, get_recipe

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(0)

    def exact(*shape: int) -> torch.Tensor:
        ints = torch.randint(-7, 8, shape, generator=g).float()
        return (ints * 2.0 ** torch.randint(-1, 2, shape, generator=g).float()).cuda()

    w, b, x0, gy = exact(90, 200), exact(90), exact(3, 23, 200), exact(3, 23, 90)
    calls: list[int] = []
    real = triton_qmm.qmm_2d

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    results = []
    monkeypatch.setattr(triton_qmm, "qmm_2d", counted)
    for on in ("0", "1"):
        monkeypatch.setenv("FP4RL_QUANTIZE_ON_LOAD", on)
        lin = torch.nn.Linear(200, 90, device="cuda")
        lin.weight.data, lin.bias.data = w.clone(), b.clone()
        layer = FP4Linear.from_linear(lin, get_recipe(recipe))
        x = x0.clone().requires_grad_()
        calls.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(gy.to(y.dtype))
        assert len(calls) == (3 if on == "1" else 0)
        results.append((y.detach(), x.grad, layer.weight.grad, layer.bias.grad))
    for a, c in zip(*results, strict=True):
        assert _same_or_both_nan(a, c)
