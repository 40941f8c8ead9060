"""The device-discipline tier: fp4rl's GPU code paths run with every tensor on a device
that is not the CPU.

PyTorch's ``meta`` device stands in for a GPU on any machine: an op mixing a CPU tensor
(a look-up table built without ``device=``) with a meta tensor raises, and so do
``.item()``, ``.tolist()`` and ``bool()`` of a meta tensor, the host syncs a CUDA graph
cannot capture and a GPU stream stalls on. Each test runs a path on meta tensors and
checks that what comes out is on meta too (indexing a CPU table with meta indices does
not raise, but gives a CPU result). Paths that cannot run on meta, and why, are listed in
docs/training.md ("What a CPU proves of the GPU path").
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import fp4rl
from fp4rl.formats import get_format
from fp4rl.formats.row_decode import decode_rows
from fp4rl.gemm import PackedOperand, mm, pack_operand, quantize_operand
from fp4rl.models import tiny_model
from fp4rl.nn.recipe import field_recipe_names, get_recipe
from fp4rl.recovery import make_recovery, recovery_variants
from fp4rl.rollout.batch import SamplingConfig
from fp4rl.rollout.sampling import sample_next

META = torch.device("meta")
BLOCK_FORMATS = ["hif4", "mxfp4", "nvfp4", "nvfp4_per_token", "nvfp4_4o6", "nvfp4_per_token_4o6",
                 "nvfp4_2d", "mxfp8_e4m3"]
FOUR_BIT = ["hif4", "mxfp4", "nvfp4"]


def on_meta(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None:
            assert t.device == META, f"a {tuple(t.shape)} tensor landed on {t.device}"


def packed_on_meta(p: PackedOperand) -> None:
    on_meta(*p.packed.fields.values(), p.scale, p.packed.tensor_scale)


@pytest.mark.parametrize("fmt", [*BLOCK_FORMATS, "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_on_the_device(fmt, dtype):
    f = get_format(fmt)
    x = torch.empty(8, 192, device=META, dtype=dtype)
    on_meta(f.quantize(x), f.quantize(x, dim=0), f.quantize_reference(x),
            f.quantize(x, rounding="stochastic"), f.quantize(x.reshape(2, 4, 192), dim=1))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_the_triton_path_around_its_launches_stays_on_the_device(fmt, monkeypatch):
    """What a GPU runs around a Triton kernel (the scales, the noise, the output, the
    arguments) on device tensors, as a CUDA tensor selects it; the launches are recorded,
    not run (a meta tensor has no kernel)."""
    pytest.importorskip("triton")
    import fp4rl.kernels.dispatch
    from fp4rl.kernels import triton_quant

    launched: list[torch.Tensor] = []
    monkeypatch.setattr(fp4rl.kernels.dispatch, "triton_for", lambda device: triton_quant)
    monkeypatch.setattr(triton_quant.Variant, "launch", lambda self, grid, *args: launched.extend(
        a for a in args if isinstance(a, torch.Tensor)))
    f = get_format(fmt)
    x = torch.empty(32, 192, device=META)
    on_meta(f.quantize(x), f.quantize(x, dim=0), f.quantize(x, rounding="stochastic"),
            f.quantize(x.reshape(2, 16, 192), dim=1), f.quantize(x.bfloat16(), dim=0))
    assert launched
    on_meta(*launched)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_encode_and_decode_on_the_device(fmt):
    f = get_format(fmt)
    packed = f.encode(torch.empty(8, 192, device=META))
    on_meta(*packed.fields.values(), packed.tensor_scale, f.decode(packed))


@pytest.mark.parametrize("fmt", FOUR_BIT)
def test_packed_operands_on_the_device(fmt):
    w = torch.empty(32, 192, device=META)
    p = pack_operand(w, get_format(fmt))
    packed_on_meta(p)
    on_meta(decode_rows(p.packed), p.decode(torch.bfloat16).values)
    again = PackedOperand.from_row_fields(get_format(fmt), (32, 192), p.row_fields(), p.scale)
    packed_on_meta(again)


@pytest.mark.parametrize("fmt", FOUR_BIT)
def test_the_packed_gemm_stays_on_the_device(fmt, monkeypatch):
    """The fused packed GEMM as a GPU selects it (through its operator, and the launch
    around its kernel: the stand-in 1.0 of an absent scale, the output, the arguments), on
    device tensors; the launch is recorded, not run."""
    pytest.importorskip("triton")
    import fp4rl.kernels.dispatch
    from fp4rl.gemm import Operand, mm_packed
    from fp4rl.kernels import triton_packed_mm, triton_quant

    launched: list[torch.Tensor] = []
    monkeypatch.setattr(fp4rl.kernels.dispatch, "triton_for", lambda device: triton_quant)
    monkeypatch.setattr(triton_quant.Variant, "launch", lambda self, grid, *args: launched.extend(
        a for a in args if isinstance(a, torch.Tensor)))
    p = pack_operand(torch.empty(32, 192, device=META), get_format(fmt))
    a = Operand(torch.empty(4, 192, device=META, dtype=torch.bfloat16))
    bias = torch.empty(32, device=META)
    on_meta(mm_packed(a, p, torch.bfloat16), mm_packed([a, a], p, torch.bfloat16, bias))
    y = triton_packed_mm.packed_mm_2d(get_format(fmt), a.values, 1, p.row_fields(), 32, 192,
                                      [None], p.scale, bias)
    assert launched and y.shape == (4, 32)
    on_meta(y, *launched)


@pytest.mark.parametrize("fmt", ["hif4", "nvfp4"])
def test_both_axes_from_one_read_stay_on_the_device(fmt, monkeypatch):
    """The two-axis quantizer as a GPU selects it (NVFP4's tensor scale computed on the
    device and read by the kernel there), launch recorded, not run."""
    pytest.importorskip("triton")
    import fp4rl.kernels.dispatch
    from fp4rl.gemm import quantize_operand_pair
    from fp4rl.kernels import triton_quant

    launched: list[torch.Tensor] = []
    monkeypatch.setattr(fp4rl.kernels.dispatch, "triton_for", lambda device: triton_quant)
    monkeypatch.setattr(triton_quant.Variant, "launch", lambda self, grid, *args: launched.extend(
        a for a in args if isinstance(a, torch.Tensor)))
    rows, cols = quantize_operand_pair(torch.empty(32, 192, device=META), get_format(fmt),
                                       torch.bfloat16)
    assert launched and rows.values.dtype == cols.values.dtype == torch.bfloat16
    on_meta(rows.values, cols.values, *launched,
            *(s for s in (rows.scale, cols.scale) if s is not None))


def test_nvfp4_tensor_scale_stays_on_the_device():
    """No host sync: the scale is a 0-dim tensor on the device, read by the GEMM there."""
    g = get_format("nvfp4").tensor_scale(torch.empty(4, 64, device=META))
    assert g is not None and g.shape == () and g.device == META


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_gemm_operands_on_the_device(fmt):
    x = torch.empty(4, 128, device=META, dtype=torch.bfloat16)
    w = torch.empty(16, 128, device=META)
    a, b = quantize_operand(x, get_format(fmt)), quantize_operand(w, get_format(fmt))
    on_meta(a.values, a.scale, mm(a, b.t(), torch.bfloat16), mm([a, a], b.t(), torch.float32))


def _meta_model(arch: str, recipe: str) -> torch.nn.Module:
    model, _ = tiny_model(arch, num_hidden_layers=8)  # past nemo-rl's 2 + 4 blocks in BF16
    fp4rl.quantize_model(model, recipe)
    return model.to(META)


#: one recipe of each family: every training precision, every rollout precision, each
#: format, and recovery on top
RECIPES = ["hif4", "mxfp4", "nvfp4", "hif4:fp4-reuse/fp4", "mxfp4:fp4/w4a8",
           "nvfp4:bf16/w16a4", "mxfp8_e4m3:fp4/w4a16", "hif4+resq-2:4", "nvfp4+resq-dense",
           *field_recipe_names()]


@pytest.mark.parametrize(("arch", "recipe"), [("llama", r) for r in RECIPES] + [
    ("qwen2", r) for r in ("hif4+resq-2:4", "nvfp4", "mxfp4:fp4/w4a8")])
def test_patched_model_trains_and_rolls_out_on_the_device(arch, recipe):
    model = _meta_model(arch, recipe)
    ids = torch.zeros(2, 8, dtype=torch.long, device=META)
    with fp4rl.rollout_mode(model):
        on_meta(model(input_ids=ids).logits)
    model(input_ids=ids).logits.float().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        on_meta(p.grad)


@pytest.mark.parametrize("fmt", ["hif4", "nvfp4"])
@pytest.mark.parametrize("variant", [v for v, _ in recovery_variants()])
def test_every_recovery_method_rolls_out_on_the_device(fmt, variant):
    model = _meta_model("llama", f"{fmt}+{variant}" if variant else fmt)
    with fp4rl.rollout_mode(model):
        on_meta(model(input_ids=torch.zeros(2, 8, dtype=torch.long, device=META)).logits)


def test_precision_policy_takes_a_device_without_autocast():
    from fp4rl.precision import active_compute_dtype, autocast

    assert not torch.amp.is_autocast_available("meta")
    x = torch.empty(2, device=META)
    with autocast(META, "bf16"):
        assert active_compute_dtype(x) == torch.float32


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("recipe", ["hif4+resq-2:4", "nvfp4", "mxfp4"])
def test_refit_payload_is_built_and_read_on_the_device(recipe, packed):
    from fp4rl.rollout.vllm.refit import RefitPayload, refit_payload

    payload = refit_payload(_meta_model("llama", recipe), torch.bfloat16, packed)
    assert payload.grids
    back = RefitPayload.from_wire(payload.to_wire())
    for g in back.grids.values():
        if isinstance(g, PackedOperand):
            packed_on_meta(g)
        else:
            on_meta(g.values, g.scale)
    on_meta(*(t for _, t in back.tensors))


@pytest.mark.parametrize("fmt", FOUR_BIT)
def test_fsdp_packed_gather_on_the_device(fmt, monkeypatch):
    """The FSDP2 packed gather's own steps (the whole weight's amax, packing the shard,
    decoding every rank's fields) on meta; the collectives are the one part stubbed
    (gloo and NCCL move real bytes), as a 1-rank gather that hands back its own."""
    import fp4rl.rollout.weight_sync as ws

    def all_gather(out: list[torch.Tensor], mine: torch.Tensor) -> None:
        for o in out:
            o.copy_(mine)

    monkeypatch.setattr(ws.dist, "all_reduce", lambda t, op=None: None)
    monkeypatch.setattr(ws.dist, "all_gather", all_gather)

    class Shard:
        shape = (32, 128)

        @staticmethod
        def to_local() -> torch.Tensor:
            return torch.empty(32, 128, device=META)

    recipe = get_recipe(fmt)
    layer = SimpleNamespace(weight=Shard(), recipe=recipe, recovery=make_recovery(
        recipe.rollout.recovery, recipe.rollout.activations, 128, 0,
        weight_format=recipe.rollout.weights))
    operand, _ = ws._gather_packed(layer, 1)
    on_meta(operand.values, operand.scale)


@pytest.mark.parametrize("config", [SamplingConfig(greedy=True),
                                    SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)])
def test_sampling_step_on_the_device(config):
    tokens, logprobs = sample_next(torch.empty(3, 50, device=META), config)
    on_meta(tokens, logprobs)
