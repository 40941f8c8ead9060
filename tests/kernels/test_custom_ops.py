"""fp4rl's quantizers as torch custom operators: the fake implementations agree with the
real ones (``torch.library.opcheck``), and a forward through them compiles whole
(``torch.compile(fullgraph=True)``) to the eager result bit for bit, as a serving engine's
compiled forward needs (:mod:`fp4rl.recovery.ops`, ``fp4rl::decode_rows``)."""

from __future__ import annotations

import pytest
import torch

from fp4rl.gemm import Operand, mm, operand_format, pack_operand, quantize_operand
from fp4rl.recovery import Recovery, make_recovery
from fp4rl.recovery.ops import TracedActivation, handle_of

FORMATS = ("hif4", "mxfp4", "nvfp4", "nvfp4_per_token")
METHODS = ("", "resq-2:4")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def method(fmt: str, spec: str):
    return make_recovery(Recovery.parse(spec), operand_format(fmt), 64, 0,
                         weight_format=operand_format(fmt))


def inputs(rows: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 64, generator=g)
    x[:, :3] *= 40.0  # outlier channels: ResQ's residual and NVFP4's scale both matter
    return x.to(dtype)


@pytest.fixture(autouse=True)
def fresh_dynamo(tmp_path_factory, monkeypatch):
    """Each test compiles afresh, with inductor's on-disk cache of this session only: a
    cache a run under another ``ATEN_CPU_CAPABILITY`` left would hand back kernels built
    for other vector widths."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.getbasetemp()
                                                      / "inductor"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_handle_names_the_settings_not_the_object():
    """A compiled artifact loaded in another process finds each layer's method by its
    handle, so equal settings give equal handles and any other setting another one."""
    assert handle_of(method("hif4", "resq-2:4")) == handle_of(method("hif4", "resq-2:4"))
    handles = {handle_of(method(fmt, spec)) for fmt in FORMATS for spec in METHODS}
    wider = make_recovery(Recovery.parse("resq-2:4"), operand_format("hif4"), 128, 0,
                          weight_format=operand_format("hif4"))
    assert len(handles) == len(FORMATS) * len(METHODS)
    assert handle_of(wider) not in handles
    assert handle_of(method("hif4", "resq-channel:0.5")) not in handles


def test_a_method_with_state_between_calls_is_refused():
    with pytest.raises(ValueError, match="keeps state between calls"):
        TracedActivation(method("hif4", "smoothquant"))


@pytest.mark.parametrize("spec", METHODS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_activation_operator_passes_opcheck(fmt, spec):
    op = TracedActivation(method(fmt, spec))
    for dtype in DTYPES.values():
        torch.library.opcheck(torch.ops.fp4rl.rollout_activation.default,
                              (inputs(5, dtype), op.handle, dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_decode_operator_passes_opcheck(fmt):
    p = pack_operand(torch.randn(6, 64), operand_format(fmt)).packed
    names = sorted(p.fields)
    torch.library.opcheck(torch.ops.fp4rl.decode_rows.default,
                          ([p.fields[n] for n in names], ",".join(names), p.format,
                           6, 64, p.dim, torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("spec", METHODS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_activation_operator_gives_the_methods_operands(fmt, spec, dtype):
    m = method(fmt, spec)
    x = inputs(7, dtype)
    want, got = m.activation(x, dtype), TracedActivation(m)(x, dtype)
    assert len(got) == len(want) == len(m.activation_scales(dtype))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.values, b.values.to(dtype))
        assert (a.scale is None) == (b.scale is None)
        # the operator hands a per-tensor scale on as one per token: the same factor
        assert a.scale is None or torch.equal(a.scale, b.scale.float().expand_as(a.scale))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("spec", METHODS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rollout_linear_compiles_whole_to_the_eager_bits(fmt, spec, dtype):
    """The rollout GEMM as the vLLM method runs it, with the weight stored dequantized and
    stored packed (decoded per call), under ``torch.compile(fullgraph=True)`` with dynamic
    token counts: equal bit for bit to the eager ``RolloutRecovery.activation`` path."""
    m = method(fmt, spec)
    op = TracedActivation(m)
    w = torch.randn(48, 64)
    dense = quantize_operand(w, operand_format(fmt))
    dense = Operand(dense.values.to(dtype), dense.scale)
    packed = pack_operand(w, operand_format(fmt))
    bias = torch.randn(48).to(dtype)

    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (mm(op(x, dtype), dense.t(), dtype, bias),
                mm(op(x, dtype), packed.decode(dtype).t(), dtype))

    compiled = torch.compile(forward, fullgraph=True, dynamic=True)
    with torch.inference_mode():
        for rows, seed in ((7, 1), (3, 2), (12, 3)):
            x = inputs(rows, dtype, seed)
            want = (mm(m.activation(x, dtype), dense.t(), dtype, bias),
                    mm(m.activation(x, dtype), packed.decode(dtype).t(), dtype))
            got = compiled(x)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), (fmt, spec, rows)


@pytest.fixture
def triton_path(monkeypatch):
    pytest.importorskip("triton")
    import fp4rl.kernels.triton_ops  # noqa: F401  (registers the operators)

    monkeypatch.setenv("FP4RL_KERNELS", "triton")
    monkeypatch.delenv("FP4RL_DISABLE_KERNELS", raising=False)


def _fields(fmt: str) -> tuple[int, int, bool]:
    from fp4rl.formats import get_format

    f = get_format(fmt)
    assert f.kernels is not None
    return int(f.kernels.code), f.block_size, f.has_tensor_scale


@pytest.mark.parametrize("fmt", ("hif4", "nvfp4", "mxfp8_e4m3"))
def test_the_triton_operators_pass_opcheck(triton_path, fmt):
    """Every operator a GPU step launches (the interpreter runs the kernels here): the
    quantizer along either axis with noise and a scale, the two-axis quantizer, NVFP4's
    amax and the fused ResQ passes; the fakes agree with the kernels' outputs."""
    x = inputs(6, torch.float32)
    code, block, has_scale = _fields(fmt)
    g = torch.tensor(0.5) if has_scale else None
    ops = torch.ops.fp4rl
    noise = torch.rand(6, 64)
    for axis, n in ((1, noise), (0, None)):
        torch.library.opcheck(ops.quantize_2d.default,
                              (x, code, block, has_scale, axis, n, g, torch.bfloat16, False))
    torch.library.opcheck(ops.quantize_both.default,
                          (x, code, block, has_scale, g, torch.bfloat16))
    torch.library.opcheck(ops.finite_amax.default, (x,))
    if not has_scale:
        torch.library.opcheck(ops.fused_resq.default, (x, code, block, has_scale, 2, 4))
        torch.library.opcheck(ops.resq_terms.default,
                              (x.bfloat16(), code, block, has_scale, 2, 4))


def test_a_dispatch_mode_sees_every_launch_of_a_training_step(triton_path):
    """An FP4 linear's forward and backward along the GPU path: each Triton launch reaches
    a TorchDispatchMode as an fp4rl operator with its tensors (NVFP4: the amax, the
    two-axis quantizer of the weight, the activation and the output gradient)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fp4rl.nn import FP4Linear, get_recipe, hold_weights

    seen: list[str] = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "fp4rl":
                seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    layer = FP4Linear.from_linear(torch.nn.Linear(64, 32), get_recipe("nvfp4"))
    x = torch.randn(8, 64, requires_grad=True)
    with Seen(), hold_weights(layer):  # the weights held, as a trainer's step holds them
        layer(x).sum().backward()
    assert seen.count("quantize_both") == 3 and "finite_amax" in seen
