"""``batch_invariant`` is never on in name only: where its fixed-order kernels cannot run
it is refused when it is turned on (one line; the CLI exits 2), and every op the mode
routes is either computed in its fixed order or refused, never passed to the library
(mixed dtypes, a bias that is not a vector, ``alpha`` / ``beta``, other axes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import fp4rl
import fp4rl.nn.invariant as invariant
from fp4rl.errors import UserError
from fp4rl.kernels.cpu import BI_CHUNK, bi_gemm, bi_softmax, load_library
from fp4rl.models import tiny_model
from fp4rl.nn.invariant import (
    BatchInvariantError,
    batch_invariant,
    check_batch_invariant,
    is_batch_invariant,
)

needs_c = pytest.mark.skipif(load_library() is None, reason="no C compiler")

_WITHOUT_LIBRARY = textwrap.dedent("""
    import torch
    import fp4rl
    from fp4rl.models import tiny_model
    from fp4rl.nn import get_recipe, quantize_model
    from fp4rl.nn.invariant import BatchInvariantError, batch_invariant, is_batch_invariant
    model = tiny_model("llama", num_hidden_layers=1)[0].eval()
    refused = []
    for turn_on in (lambda: fp4rl.set_batch_invariant(model),
                    lambda: quantize_model(model, get_recipe("hif4"), batch_invariant=True)):
        try:
            turn_on()
        except BatchInvariantError as err:
            refused.append(str(err))
    try:
        with batch_invariant():
            torch.randn(3, 8) @ torch.randn(8, 4)
    except BatchInvariantError as err:
        refused.append(str(err))
    print(is_batch_invariant(model))
    for line in refused:
        print(line)
""")


def test_without_the_c_library_the_mode_is_refused_in_one_line():
    """``FP4RL_DISABLE_KERNELS=1`` (the same as no C compiler for the kernels' loader):
    turning the mode on is refused, the model stays off, and an op under the mode is
    refused rather than run by the CPU's BLAS."""
    env = {**os.environ, "FP4RL_DISABLE_KERNELS": "1"}
    env.pop("FP4RL_KERNELS", None)
    run = subprocess.run([sys.executable, "-c", _WITHOUT_LIBRARY], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0] == "False"
    assert len(lines) == 4
    for line in lines[1:]:
        assert line.startswith("batch_invariant needs fp4rl's fixed-order kernels")
        assert "FP4RL_DISABLE_KERNELS=1" in line and "turn batch_invariant off" in line


def test_the_cli_refuses_the_mode_before_loading_anything(tmp_path, tiny_llama_dir):
    env = {**os.environ, "FP4RL_DISABLE_KERNELS": "1"}
    env.pop("FP4RL_KERNELS", None)
    run = subprocess.run([sys.executable, "-m", "fp4rl", "train", "--output",
                          str(tmp_path / "run"), f"model={tiny_llama_dir}",
                          "batch_invariant=true", "device=cpu", "--steps", "1"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr
    assert "batch_invariant needs fp4rl's fixed-order kernels" in lines[0]
    assert not (tmp_path / "run").exists()


def test_no_compiler_is_refused_when_the_mode_is_set(monkeypatch):
    monkeypatch.delenv("FP4RL_KERNELS", raising=False)
    monkeypatch.delenv("FP4RL_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(invariant, "load_library", lambda: None)
    model = tiny_model("llama", num_hidden_layers=1)[0].eval()
    with pytest.raises(BatchInvariantError, match=r"no C compiler.*install gcc or set CC"):
        fp4rl.set_batch_invariant(model)
    assert not is_batch_invariant(model)
    assert issubclass(BatchInvariantError, UserError)


def test_no_triton_is_refused_on_a_gpu(monkeypatch):
    monkeypatch.delenv("FP4RL_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(invariant, "_triton_imports", lambda: False)
    with pytest.raises(BatchInvariantError, match="on cuda tensors needs Triton"):
        check_batch_invariant("cuda")
    monkeypatch.setenv("FP4RL_KERNELS", "triton")
    with pytest.raises(BatchInvariantError, match="on cpu tensors needs Triton"):
        check_batch_invariant("cpu")


def test_a_device_without_kernels_is_refused(monkeypatch):
    monkeypatch.delenv("FP4RL_DISABLE_KERNELS", raising=False)
    with pytest.raises(BatchInvariantError, match="no fixed-order kernels for mps tensors"):
        check_batch_invariant("mps")


# ----- every routed op computed in its fixed order, or refused -------------------------

def _rows_alone(fn, a: torch.Tensor) -> torch.Tensor:
    """``fn`` of each row of ``a`` alone, stacked: what a batch-invariant op gives them
    together."""
    return torch.cat([fn(a[i:i + 1]) for i in range(a.shape[0])])


@pytest.fixture
def c_kernels(monkeypatch):
    if load_library() is None:
        pytest.skip("no C compiler")
    monkeypatch.delenv("FP4RL_KERNELS", raising=False)
    monkeypatch.delenv("FP4RL_DISABLE_KERNELS", raising=False)


def _data(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def test_mixed_dtypes_are_promoted_as_torch_does_and_run_the_fixed_order_kernel(c_kernels):
    a, w, bias = _data((9, 70), (70, 20), (20,))
    a16 = a.bfloat16()
    with batch_invariant():
        mixed = torch.addmm(bias, a16, w.bfloat16())  # a float32 bias beside bf16 operands
        half = torch.mm(a.half(), w.half())
        rows = _rows_alone(lambda r: torch.addmm(bias, r, w.bfloat16()), a16)
    assert mixed.dtype == torch.float32  # torch's promotion
    assert torch.equal(mixed, bi_gemm(a16.float(), w.bfloat16().float(), bias))
    assert torch.equal(rows, mixed)
    assert half.dtype == torch.float16
    assert torch.equal(half, bi_gemm(a.half().float(), w.half().float()).half())


@pytest.mark.parametrize(("alpha", "beta"), [(1, 1), (0.5, 1), (1, 2.0), (3, 0)])
@pytest.mark.parametrize("bias_shape", [(20,), (1, 20), (9, 20), (9, 1), ()])
def test_addmm_of_any_bias_and_scaling_is_row_local_and_fixed_order(c_kernels, alpha, beta,
                                                                     bias_shape):
    a, w = _data((9, 70), (70, 20))
    bias = torch.randn(bias_shape) if bias_shape else torch.tensor(0.75)
    with batch_invariant():
        out = torch.addmm(bias, a, w, beta=beta, alpha=alpha)
        if bias.dim() < 2 or bias.shape[0] == 1:  # a bias shared by the rows: rows alone
            rows = _rows_alone(lambda r: torch.addmm(bias, r, w, beta=beta, alpha=alpha), a)
            assert torch.equal(rows, out)
    product = bi_gemm(a, w, chunk=BI_CHUNK)  # the fixed-order GEMM, then elementwise
    assert torch.equal(out, product * alpha + (bias * beta if beta else 0))
    assert torch.allclose(out, torch.addmm(bias, a, w, beta=beta, alpha=alpha), atol=1e-4)


def test_baddbmm_is_the_sequential_gemm_then_elementwise(c_kernels):
    p, v, base = _data((3, 4, 11), (3, 11, 5), (3, 4, 5))
    with batch_invariant():
        out = torch.baddbmm(base, p, v, beta=0.5, alpha=2)
    assert torch.equal(out, bi_gemm(p, v, chunk=0) * 2 + base * 0.5)


def test_softmax_along_another_axis_is_each_rows_own(c_kernels):
    (x,) = _data((40, 6, 3))
    with batch_invariant():
        out = torch.softmax(x, dim=0)
        log = torch.log_softmax(x, dim=1)
    assert torch.equal(out, bi_softmax(x.movedim(0, -1), False).movedim(-1, 0))
    assert torch.equal(log, bi_softmax(x.movedim(1, -1), True).movedim(-1, 1))
    assert torch.allclose(out, torch.softmax(x, 0), atol=1e-6)


def test_reductions_over_several_axes_or_all(c_kernels):
    (x,) = _data((5, 7, 300))
    with batch_invariant():
        lse = torch.logsumexp(x, dim=(0, 2))
        lse_kept = torch.logsumexp(x, dim=(0, 2), keepdim=True)
        mean = x.mean()
        mean_axes = x.mean(dim=(1, 2), keepdim=True)
        mean_bf16 = x.bfloat16().mean(-1, dtype=torch.float32)
    assert lse.shape == (7,) and lse_kept.shape == (1, 7, 1)
    assert torch.equal(lse_kept.reshape(7), lse)
    assert torch.allclose(lse, torch.logsumexp(x, dim=(0, 2)), atol=1e-5)
    assert mean.shape == () and torch.allclose(mean, x.mean(), atol=1e-6)
    assert mean_axes.shape == (5, 1, 1) and torch.allclose(mean_axes, x.mean((1, 2), True))
    assert mean_bf16.dtype == torch.float32
    assert torch.equal(mean_bf16, _rows_alone(
        lambda r: invariant.bi_row_mean(r.bfloat16(), torch.float32), x.reshape(-1, 300)
    ).reshape(5, 7))


def test_what_no_kernel_computes_is_refused(c_kernels):
    a = torch.randn(3, 4, dtype=torch.float64)
    with batch_invariant(), pytest.raises(BatchInvariantError, match=r"mm in torch\.float64"):
        a @ a.t()
    x = torch.randn(3, 4)
    with batch_invariant(), pytest.raises(BatchInvariantError, match=r"aten\.mm\.out"):
        torch.mm(x, x.t(), out=torch.empty(3, 3))
    q = torch.randn(1, 2, 5, 8)
    with batch_invariant(), pytest.raises(BatchInvariantError, match="attn_implementation"):
        F.scaled_dot_product_attention(q, q, q)


def test_exact_and_empty_ops_pass_and_meta_reaches_the_kernels_fakes(c_kernels):
    ints = torch.randint(-5, 5, (4, 6))
    exact = ints @ ints.t()
    with batch_invariant():
        assert torch.equal(ints @ ints.t(), exact)
        assert torch.softmax(torch.empty(0, 5), -1).shape == (0, 5)
        meta = torch.empty(3, 4, device="meta") @ torch.empty(4, 5, device="meta")
        lse = torch.logsumexp(torch.empty(3, 4, device="meta"), -1)
    assert meta.device.type == "meta" and meta.shape == (3, 5) and lse.shape == (3,)
