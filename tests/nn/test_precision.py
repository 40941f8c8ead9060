"""The precision policy: exact bf16 operands, bf16-compute FP4 GEMMs, FP32 masters that
move at lr 1e-6, the refusal of ``dtype``, and device selection."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp4rl
from fp4rl import precision
from fp4rl.cli import main
from fp4rl.errors import UserError
from fp4rl.gemm import mm, quantize_operand
from fp4rl.models import tiny_model
from fp4rl.nn import FP4Linear, Recipe, RolloutPrecision, get_recipe
from fp4rl.recovery import Recovery
from fp4rl.rl import rewards
from fp4rl.rl.config import ConfigError, load_config
from fp4rl.rl.trainer import Trainer

OPERAND_FORMATS = ["hif4", "mxfp4", "nvfp4", "nvfp4_per_token", "mxfp8_e4m3"]
TRAIN_FORMATS = ["hif4", "mxfp4", "nvfp4", "nvfp4_per_token"]


def heavy_tailed(*shape: int, seed: int = 0) -> torch.Tensor:
    """Gaussian values with a few large outliers, as LLM activations have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    spikes = torch.rand(*shape, generator=g) < 0.01
    return torch.where(spikes, x * 300, x)


@pytest.mark.parametrize("fmt", OPERAND_FORMATS)
@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_operands_are_exact_in_bf16(fmt, dim, rounding):
    x = heavy_tailed(96, 128)
    kw = {"stochastic": rounding == "stochastic"}
    op = quantize_operand(x, fp4rl.get_format(fmt), dim,
                          generator=torch.Generator().manual_seed(1), **kw)
    assert torch.equal(op.values.to(torch.bfloat16).float(), op.values)  # bf16 holds it
    want = fp4rl.quantize(x, fmt, dim=dim, rounding=rounding,
                          generator=torch.Generator().manual_seed(1))
    assert torch.equal(op.dense(), want)  # bit for bit the fp32 path's operand
    assert (op.scale is not None) == fmt.startswith("nvfp4")


def test_nvfp4_scaled_values_are_not_bf16_exact():
    """Why the per-tensor scale stays outside the product: g * s * e can need > 8 bits."""
    x = heavy_tailed(64, 128, seed=3) * 1.2345
    q = fp4rl.quantize(x, "nvfp4")
    assert not torch.equal(q.to(torch.bfloat16).float(), q)


def _fp64_products(layer: FP4Linear, x: torch.Tensor, g: torch.Tensor, fmt: str):
    ref = lambda t, d: fp4rl.get_format(fmt).quantize_reference(t, dim=d).double()  # noqa: E731
    w = layer.weight.detach()
    qw = lambda d: fp4rl.get_format(layer.recipe.train.weights).quantize_reference(  # noqa: E731
        w, dim=d).double()
    y = ref(x, -1) @ qw(-1).t() + layer.bias.detach().double()
    return y, ref(g, -1) @ qw(0), ref(g, 0).t() @ ref(x, 0)


def _close_to_bf16_rounding(got: torch.Tensor, want: torch.Tensor,
                            scale: torch.Tensor | None = None) -> None:
    """Within two bf16 roundings (2^-8 each, relative to the magnitude ``scale`` of the
    summed terms; default ``|want|``) plus fp32 accumulation error."""
    scale = want.abs() if scale is None else scale
    err = (got.double() - want).abs()
    assert (err <= 2**-7 * scale + 1e-6 * scale.max()).all(), (err / scale).max()


@pytest.mark.parametrize("fmt", TRAIN_FORMATS)
def test_bf16_compute_linear_matches_fp64_product_of_same_operands(fmt):
    torch.manual_seed(0)
    layer = FP4Linear.from_linear(nn.Linear(128, 64), Recipe(train=get_recipe(fmt).train))
    x = heavy_tailed(80, 128, seed=1).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    g = torch.randn(80, 64).to(torch.bfloat16)
    y.backward(g)
    want_y, want_dx, want_dw = _fp64_products(layer, x.detach(), g.float(), fmt)
    bias = layer.bias.detach().double()
    _close_to_bf16_rounding(y.detach(), want_y, (want_y - bias).abs() + bias.abs())
    _close_to_bf16_rounding(x.grad, want_dx)
    assert layer.weight.grad.dtype == torch.float32  # FP32 master gradient
    _close_to_bf16_rounding(layer.weight.grad, want_dw)


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
@pytest.mark.parametrize("sparsity", ["dense", "2:4"])
def test_fused_resq_sum_is_exact_so_its_terms_separate(fmt, sparsity):
    """The bf16 rollout takes S(Q(x - Q(x))) as fused - Q(x): exact because the fused
    kernel's fp32 sum is; checked against the composed steps over heavy-tailed rows."""
    for seed in range(5):
        x = heavy_tailed(64, 576, seed=seed) * torch.rand(64, 1) * 100
        qx = fp4rl.quantize(x, fmt)
        pattern = fp4rl.recovery.parse_pattern(sparsity)
        second = fp4rl.recovery.resq_activation(x, fp4rl.get_format(fmt), pattern) - qx
        assert torch.equal(second, fp4rl.recovery.sparsify(fp4rl.quantize(x - qx, fmt),
                                                           sparsity))
        assert torch.equal(second.to(torch.bfloat16).float(), second)


@pytest.mark.parametrize("fmt", ["hif4", "nvfp4"])
@pytest.mark.parametrize("sparsity", ["dense", "2:4"])
def test_bf16_resq_rollout_keeps_both_terms_exact(fmt, sparsity):
    """ResQ's Q(x) + S(Q(x - Q(x))) does not fit bf16; its two GEMMs stay apart."""
    torch.manual_seed(0)
    rec = Recovery.make("resq", sparsity=sparsity)
    layer = FP4Linear.from_linear(nn.Linear(128, 64, bias=False),
                                  Recipe(rollout=RolloutPrecision(weights=fmt, activations=fmt,
                                                                  recovery=rec)))
    x = heavy_tailed(40, 128, seed=2)
    with fp4rl.rollout_mode(layer), torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    qx = fp4rl.quantize(x, fmt)
    res = fp4rl.recovery.sparsify(fp4rl.quantize(x - qx, fmt), sparsity)
    qw = fp4rl.quantize(layer.weight.detach(), fmt).double()
    terms = qx.double() @ qw.t(), res.double() @ qw.t()
    _close_to_bf16_rounding(y, terms[0] + terms[1], terms[0].abs() + terms[1].abs())
    folded = (qx + res).to(torch.bfloat16)
    assert not torch.equal(folded.float(), qx + res)  # folding would have rounded


def test_unquantized_element_computes_in_the_compute_dtype():
    """A recipe's ``bf16`` is no quantization: the layer is then nn.Linear under autocast."""
    torch.manual_seed(0)
    plain = nn.Linear(128, 64)
    layer = FP4Linear.from_linear(nn.Linear(128, 64), Recipe())
    layer.load_state_dict(plain.state_dict())
    x = torch.randn(16, 128)
    assert torch.equal(layer(x), plain(x))  # fp32: exactly the fp32 layer
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x), plain(x))


def test_backward_keeps_one_compute_dtype_activation():
    """What the layer saves for backward: Q(X) along tokens in bf16, and the weight."""
    layer = FP4Linear.from_linear(nn.Linear(256, 128), get_recipe("hif4"))
    x = torch.randn(64, 256, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    extra = [t for t in saved if t is not layer.weight]
    assert [(t.dtype, tuple(t.shape)) for t in extra] == [(torch.bfloat16, (64, 256))]


def _tiny_step_model():
    model, _ = tiny_model("llama", seed=0)
    fp4rl.quantize_model(model, get_recipe("hif4"))
    ids = torch.randint(0, model.config.vocab_size, (4, 12),
                        generator=torch.Generator().manual_seed(0))
    return model, ids


def test_fp32_masters_move_at_paper_learning_rate():
    """Two AdamW steps at lr 1e-6 move ~every FP32 master weight; bf16 weights barely."""
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, ids = _tiny_step_model()
        model.to(dtype)
        start = {n: p.detach().clone() for n, p in model.named_parameters() if "proj" in n}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
            loss.backward()
            opt.step()
        params = dict(model.named_parameters())
        changed = sum((params[n] != w).sum().item() for n, w in start.items())
        moved[dtype] = changed / sum(w.numel() for w in start.values())
    assert moved[torch.float32] >= 0.99
    assert moved[torch.bfloat16] < 0.05


def test_trainer_resolves_precision_and_keeps_fp32_masters(tmp_path):
    rewards.register_reward("has_digit", lambda c, r: float(any(ch.isdigit() for ch in c)),
                            replace=True)
    model, tok = tiny_model("llama")
    model.to(torch.bfloat16)
    cfg = load_config(None, ["mixed_precision=bf16", "device=cpu", "grpo.num_generations=2",
                             "grpo.batch_size=2", "grpo.max_response_length=4",
                             "data.train_size=4", "data.reward=has_digit", "run.steps=1"])
    logs = []
    trainer = Trainer(cfg, tmp_path, model, tok, log=logs.append)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert trainer.cfg.mixed_precision == "bf16" and trainer.cfg.device == "cpu"
    assert any("mixed_precision=bf16" in line for line in logs)
    metrics = trainer.train()[0]
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items()
               if isinstance(v, float))


def test_auto_follows_native_bf16(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "cpu_info", lambda: ("test CPU", ("avx512_bf16",)))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert precision.resolve_mixed_precision("auto", cpu) == "bf16"
    # the flag is there, but torch or oneDNN are held to the avx2 code path
    for capability, isa in (("AVX2", "ALL"), ("AVX512", "AVX2")):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        assert precision.resolve_mixed_precision("auto", cpu) == "no"
        assert "unused" in precision.describe_cpu()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert precision.resolve_mixed_precision("auto", cpu) == "bf16"
    assert precision.slow_bf16_note("bf16", cpu) is None
    monkeypatch.setattr(precision, "cpu_info", lambda: ("test CPU", ()))
    assert precision.resolve_mixed_precision("auto", cpu) == "no"
    assert "slower" in precision.slow_bf16_note("bf16", cpu)
    assert precision.resolve_mixed_precision("no", cpu) == "no"
    assert "test CPU" in precision.describe_cpu()


def test_dtype_is_refused_with_one_line(capsys, tmp_path):
    """transformers' ``dtype``, TRL's ``bf16``: refused, naming fp4rl's setting for them."""
    for other in ("dtype=bfloat16", "torch_dtype=bfloat16", "bf16=true"):
        with pytest.raises(ConfigError, match=r"fp4rl's setting for it is mixed_precision"):
            load_config(None, [other])
    assert main(["train", "--output", str(tmp_path / "run"), "dtype=bfloat16"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "mixed_precision" in err
    assert "Traceback" not in err


def test_device_selection_on_cpu(capsys, tmp_path):
    assert precision.resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert precision.resolve_device("auto") == torch.device("cpu")
        with pytest.raises(UserError, match="no CUDA GPU"):
            precision.resolve_device("cuda:0")
        assert main(["train", "--output", str(tmp_path / "run"), "device=cuda"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "device=cpu" in err
    with pytest.raises(UserError, match="not a device"):
        precision.resolve_device("gpu0")
    with pytest.raises(UserError, match="not supported"):
        precision.resolve_device("meta")


def _exact_products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in float64 of few-bit values, K = 32: every partial sum exact, so the fp32
    accumulator of any order holds this value (asserted)."""
    exact = a.double() @ b.double()
    assert torch.equal(exact.float().double(), exact)
    return exact.float()


def _grid_values(rows: int, cols: int, seed: int) -> torch.Tensor:
    """E2M1 values times powers of two: FP4 operands, exact in bf16."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    v = grid[torch.randint(0, 8, (rows, cols), generator=g)]
    sign = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
    return (sign * v * torch.exp2(torch.randint(-2, 3, (rows, 1), generator=g).float())
            ).bfloat16()


def test_mm_of_two_bf16_terms_rounds_their_fp32_sum_once():
    """ResQ's two products in bf16: the fp32 accumulators of both, summed in fp32 and
    rounded to bf16 once; rounding each product to bf16 first (what a bf16 GEMM returns)
    would round twice and differ."""
    q = _grid_values(64, 32, seed=6)
    r = (_grid_values(64, 32, seed=7).float() * 2.0**-5).bfloat16()
    w = _grid_values(32, 48, seed=8)
    want = (_exact_products(q, w) + _exact_products(r, w)).bfloat16()
    got = mm([fp4rl.gemm.Operand(q), fp4rl.gemm.Operand(r)], fp4rl.gemm.Operand(w.t()).t(),
             torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    twice = ((q @ w).float() + (r @ w).float()).bfloat16()
    assert not torch.equal(twice, want)  # the double rounding this replaced


def test_mm_applies_per_tensor_scales_to_the_fp32_accumulator_and_rounds_once():
    """NVFP4's global scales: exact K = 32 products, times each scale in fp32 (in mm's
    order: the left operand's, then the right's), rounded to bf16 once. Rounding the
    product to bf16 before scaling (as a bf16 GEMM's output would) differs."""
    a = _grid_values(64, 32, seed=1)
    b = _grid_values(32, 48, seed=2)
    ga, gb = torch.tensor(0.0371), torch.tensor(1.337)
    got = mm(fp4rl.gemm.Operand(a, ga), fp4rl.gemm.Operand(b.t(), gb).t(), torch.bfloat16)
    want = (_exact_products(a, b) * ga * gb).bfloat16()
    assert torch.equal(got, want)
    twice = ((a @ b).float() * ga * gb).bfloat16()
    assert (twice != want).float().mean() > 0.01


def test_mm_of_scaled_operands_matches_dense_product():
    nvfp4 = fp4rl.get_format("nvfp4")
    a = quantize_operand(heavy_tailed(32, 64, seed=4), nvfp4)
    b = quantize_operand(heavy_tailed(48, 64, seed=5), nvfp4)
    want = a.dense().double() @ b.dense().double().t()
    _close_to_bf16_rounding(mm(a, b.t(), torch.bfloat16), want)
    torch.testing.assert_close(mm(a, b.t(), torch.float32).double(), want, rtol=1e-6,
                               atol=1e-6 * want.abs().max().item())


def test_mm_fp32_on_the_cpu_reads_bf16_as_it_is():
    """No fp32 GEMM in torch takes bf16 operands on a CPU: ``mm_fp32`` runs fp4rl's C GEMM
    on them (the tile unit where the CPU has AMX, in one sum of all K), kept packed for a
    weight held by ``hold_weights``, and close to the float64 product; in the
    batch-invariant forward, that mode's runs of 64 k's; an autograd-tracked operand takes
    the widened fp32 GEMM, which autograd differentiates."""
    from fp4rl.gemm import mm_fp32
    from fp4rl.kernels.cpu import BI_CHUNK, BI_NO_RUNS, bi_gemm, keep_panels, load_library
    from fp4rl.nn.invariant import batch_invariant

    if load_library() is None:
        pytest.skip("needs fp4rl's C kernels")
    g = torch.Generator().manual_seed(9)
    a = torch.randn(24, 576, generator=g).bfloat16()
    w = torch.randn(300, 576, generator=g).bfloat16()
    got = mm_fp32(a, w.t())
    assert got.dtype == torch.float32
    assert torch.equal(got, bi_gemm(a, w.t(), out_dtype=torch.float32, chunk=BI_NO_RUNS))
    with keep_panels():
        assert torch.equal(mm_fp32(a, w.t()), got)
        assert torch.equal(mm_fp32(a[:5], w.t()), got[:5])
    with batch_invariant():
        runs = mm_fp32(a, w.t())
    assert torch.equal(runs, bi_gemm(a, w.t(), out_dtype=torch.float32, chunk=BI_CHUNK))
    exact = a.double() @ w.t().double()
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-4)
    tracked = a.clone().requires_grad_()
    wide = mm_fp32(tracked, w.t())
    wide.sum().backward()
    assert tracked.grad is not None and torch.allclose(wide.detach(), got, rtol=1e-5,
                                                       atol=1e-4)


def test_the_cpu_gemm_operator_passes_opcheck():
    from fp4rl.kernels.cpu import load_library

    if load_library() is None:
        pytest.skip("needs fp4rl's C kernels")
    import fp4rl.kernels.cpu_ops  # noqa: F401  (registers fp4rl::c_mm_fp32)

    g = torch.Generator().manual_seed(10)
    a = torch.randn(9, 96, generator=g).bfloat16()
    w = torch.randn(40, 96, generator=g).bfloat16()
    torch.library.opcheck(torch.ops.fp4rl.c_mm_fp32.default, (a, w.t(), 64))
    torch.library.opcheck(torch.ops.fp4rl.c_mm_fp32.default, (a, w.t(), -1))
