"""``fp4rl export``: each format loads in the tool meant to read it, with the weights
``fp4rl.quantize`` gives (an independent path: never the export's own decoder alone)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

import fp4rl
from fp4rl.cli import main
from fp4rl.export import ExportError, check_format, export_model
from fp4rl.models import load_model, tiny_model
from fp4rl.rl import checkpoint as ckpt
from fp4rl.rl.config import load_config

# compressed-tensors 0.20 dequantizes NVFP4 into bf16 (codes and E4M3 scales unpacked to
# bf16, product cast back to bf16): fp4rl's float32 value rounded to bf16 (2^-8 relative),
# plus the 2 float32 ulps by which its arithmetic may differ before that cast.
NVFP4_RTOL = 2**-8 + 2**-21


def block_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Weights of the linears inside transformer blocks, found without fp4rl's helpers."""
    return {f"{name}.weight": module.weight.detach() for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and ".layers." in name}


def other_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    blocks = block_weights(model)
    return {k: v for k, v in model.state_dict().items() if k not in blocks}


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def stored_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return tensors


def load_compressed(directory) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, local_files_only=True,
        quantization_config=CompressedTensorsConfig(dequantize=True))


@pytest.fixture(params=["llama", "qwen2"])
def tiny(request):
    return tiny_model(request.param, seed=3)


def test_bf16_export_loads_with_plain_transformers(tiny, tmp_path):
    model, tok = tiny
    result = export_model(model, tok, "bf16", tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    state = loaded.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], bf16(tensor)), name
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert {t.dtype for t in stored_tensors(tmp_path / "out").values()} == {torch.bfloat16}
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= files
    assert result.ratio == pytest.approx(1.0, abs=0.02)
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700


def test_mxfp4_export_is_compressed_tensors_and_bit_exact(tiny, tmp_path):
    model, tok = tiny
    result = export_model(model, tok, "mxfp4", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == "mxfp4-pack-quantized" and config["ignore"] == ["lm_head"]
    assert config["config_groups"]["group_0"]["weights"]["group_size"] == 32
    stored = stored_tensors(tmp_path / "out")
    for name, w in block_weights(model).items():
        module = name.removesuffix(".weight")
        out, inp = w.shape
        assert stored[f"{module}.weight_packed"].dtype == torch.uint8
        assert stored[f"{module}.weight_packed"].shape == (out, inp // 2)
        assert stored[f"{module}.weight_scale"].dtype == torch.uint8
        assert stored[f"{module}.weight_scale"].shape == (out, inp // 32)
        assert f"{module}.weight_global_scale" not in stored
    state = load_compressed(tmp_path / "out").state_dict()
    for name, w in block_weights(model).items():
        assert torch.equal(state[name], fp4rl.quantize(w, "mxfp4", dim=-1)), name
    for name, tensor in other_tensors(model).items():
        assert torch.equal(state[name], bf16(tensor)), name
    assert result.ratio < 0.5


def test_nvfp4_export_is_compressed_tensors_within_bf16_rounding(tiny, tmp_path):
    model, tok = tiny
    export_model(model, tok, "nvfp4", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "nvfp4-pack-quantized"
    assert config["config_groups"]["group_0"]["weights"]["strategy"] == "tensor_group"
    stored = stored_tensors(tmp_path / "out")
    state = load_compressed(tmp_path / "out").state_dict()
    for name, w in block_weights(model).items():
        module = name.removesuffix(".weight")
        out, inp = w.shape
        assert stored[f"{module}.weight_scale"].dtype == torch.float8_e4m3fn
        assert stored[f"{module}.weight_scale"].shape == (out, inp // 16)
        global_scale = stored[f"{module}.weight_global_scale"]
        assert global_scale.dtype == torch.float32 and global_scale.shape == (1,)
        # compressed-tensors' convention 6 * 448 / amax: the reciprocal of fp4rl's scale
        assert global_scale.item() == pytest.approx(6 * 448 / w.abs().max().item(), rel=1e-6)
        g = fp4rl.get_format("nvfp4").tensor_scale(w)
        assert global_scale.item() == torch.tensor(1 / g.item(), dtype=torch.float32).item()
        ref = fp4rl.quantize(w, "nvfp4", dim=-1)
        torch.testing.assert_close(state[name], ref, rtol=NVFP4_RTOL, atol=0)
        # mostly exactly bf16(ref); double rounding may move a few values by one bf16 ulp
        assert (state[name] != bf16(ref)).float().mean() <= 0.01, name
    for name, tensor in other_tensors(model).items():
        assert torch.equal(state[name], bf16(tensor)), name


def test_hif4_export_round_trips_through_load_model(tiny, tmp_path):
    model, tok = tiny
    export_model(model, tok, "hif4", tmp_path / "out")
    loaded, loaded_tok = load_model(str(tmp_path / "out"))
    state = loaded.state_dict()
    for name, w in block_weights(model).items():
        assert torch.equal(state[name], fp4rl.quantize(w, "hif4", dim=-1)), name
    for name, tensor in other_tensors(model).items():
        assert torch.equal(state[name], bf16(tensor)), name
    assert loaded_tok("12+3").input_ids == tok("12+3").input_ids


def test_hif4_export_stores_4_5_bit_codes(tmp_path):
    model, tok = tiny_model("llama")
    export_model(model, tok, "hif4", tmp_path / "out")
    stored = stored_tensors(tmp_path / "out")
    for name, w in block_weights(model).items():
        fields = {k: v for k, v in stored.items() if k.startswith(name + "_")}
        assert set(fields) == {f"{name}_{f}" for f in ("codes", "scale", "level2", "level3")}
        assert {v.dtype for v in fields.values()} == {torch.uint8}
        out, inp = w.shape
        assert fields[f"{name}_codes"].shape == (out, inp // 2)
        assert fields[f"{name}_level3"].shape == (out, inp // 32)
        bits = 8 * sum(v.numel() for v in fields.values())
        assert bits / w.numel() == 4.5
    description = json.loads((tmp_path / "out" / "fp4rl-packed.json").read_text())
    assert description["format"] == "hif4" and description["block_size"] == 64
    with pytest.raises(OSError):  # no model.safetensors: never silently random weights
        AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_recipe_ignore_keeps_layers_in_bf16(tmp_path):
    model, tok = tiny_model("llama")
    down = lambda name: name.endswith("down_proj")  # noqa: E731
    export_model(model, tok, "mxfp4", tmp_path / "mx", ignores=down)
    export_model(model, tok, "hif4", tmp_path / "hif4", ignores=down)
    config = json.loads((tmp_path / "mx" / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj",
                                "lm_head"]
    for state in (load_compressed(tmp_path / "mx").state_dict(),
                  load_model(str(tmp_path / "hif4"))[0].state_dict()):
        for name, w in block_weights(model).items():
            if "down_proj" in name:
                assert torch.equal(state[name], bf16(w)), name
            else:
                assert not torch.equal(state[name], bf16(w)), name


@pytest.fixture
def trained_run(tmp_path, tiny_llama_dir):
    """A run directory with one checkpoint whose weights differ from the base model's."""
    model, _ = load_model(str(tiny_llama_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    cfg = load_config(None, [f"model={tiny_llama_dir}", "train.weights=hif4",
                             "ignore=['re:.*\\.0\\.mlp\\.up_proj']"])
    run = tmp_path / "run"
    ckpt.save_checkpoint(run, 1, model, torch.optim.AdamW(model.parameters()),
                         {"step": 1, "config": cfg.model_dump()})
    return run, model


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
def test_cli_exports_a_run_and_a_checkpoint(trained_run, tmp_path, capsys, fmt):
    run, model = trained_run
    for source, out in ((run, tmp_path / "from-run"), (ckpt.step_dir(run, 1), tmp_path / "one")):
        assert main(["export", "--checkpoint", str(source), "--format", fmt,
                     "--output", str(out)]) == 0
        line = capsys.readouterr().out
        assert f"{fmt} export in" in line and "x the bf16 export's" in line
        state = (load_model(str(out))[0] if fmt == "hif4" else load_compressed(out)).state_dict()
        for name, w in block_weights(model).items():
            want = bf16(w) if name == "model.layers.0.mlp.up_proj.weight" else \
                fp4rl.quantize(w, fmt, dim=-1)
            assert torch.equal(state[name], want), name


def run_cli(capsys, *args: str) -> str:
    """The error line of a failing command (exit 2): one line, the last one (a model that
    loaded before the error may have drawn transformers' progress bar above it)."""
    assert main(["export", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("error") == 1 and err.splitlines()[-1].startswith("fp4rl export: error:")
    return err.splitlines()[-1]


def test_cli_bad_inputs_are_one_line(tmp_path, capsys, tiny_llama_dir):
    out = str(tmp_path / "out")
    err = run_cli(capsys, "--model", str(tiny_llama_dir), "--format", "hif5", "--output", out)
    assert "did you mean 'hif4'" in err
    not_a_run = tmp_path / "empty"
    not_a_run.mkdir()
    err = run_cli(capsys, "--checkpoint", str(not_a_run), "--format", "bf16", "--output", out)
    assert "neither a checkpoint" in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    err = run_cli(capsys, "--model", str(tiny_llama_dir), "--format", "bf16",
                  "--output", str(tmp_path / "full"))
    assert "not an empty directory" in err
    assert not (tmp_path / "out").exists()


def test_cli_unblockable_shape_names_the_layer(tmp_path, capsys):
    model, tok = tiny_model("llama", hidden_size=96)
    model.save_pretrained(tmp_path / "m96")
    tok.save_pretrained(tmp_path / "m96")
    err = run_cli(capsys, "--model", str(tmp_path / "m96"), "--format", "hif4",
                  "--output", str(tmp_path / "out"))
    assert "model.layers.0.self_attn.q_proj" in err and "in_features (96)" in err
    assert "block size 64" in err
    assert main(["export", "--model", str(tmp_path / "m96"), "--format", "mxfp4",
                 "--output", str(tmp_path / "out")]) == 0  # 96 = 3 blocks of 32
    assert not list(tmp_path.glob(".out.*")), "a failed export left its temporary directory"


def test_missing_compressed_tensors_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)
    with pytest.raises(ExportError, match=r'pip install "compressed-tensors==0\.20\.0"'):
        check_format("nvfp4")
    assert check_format("HiF4") == "hif4"


@pytest.mark.slow
def test_embedded_model_exports(tmp_path):
    """SmolLM2-135M: every 4-bit export loads back to fp4rl.quantize of its weights."""
    model, tok = load_model("smollm2-135m")
    weights = block_weights(model)
    sizes = {}
    for fmt in ("mxfp4", "nvfp4", "hif4"):
        result = export_model(model, tok, fmt, tmp_path / fmt)
        sizes[fmt] = result.ratio
        state = (load_model(str(tmp_path / fmt))[0] if fmt == "hif4"
                 else load_compressed(tmp_path / fmt)).state_dict()
        for name, w in weights.items():
            ref = fp4rl.quantize(w, fmt, dim=-1)
            if fmt == "nvfp4":
                torch.testing.assert_close(state[name], ref, rtol=NVFP4_RTOL, atol=0)
            else:
                assert torch.equal(state[name], ref), name
        del state
    assert sizes["mxfp4"] < sizes["nvfp4"] <= sizes["hif4"] < 0.5


def test_an_export_format_of_ones_own_registers_once(monkeypatch, tmp_path):
    from fp4rl.export import registry
    from fp4rl.export.directory import Payload, unquantized_tensors

    fp32 = registry.ExportFormat(
        "fp32", lambda model, ignores, recipe: Payload(unquantized_tensors(model, skip=set())))
    registry.register_export_format(fp32)
    assert registry.list_export_formats()[-1] == "fp32"
    assert check_format("FP32") == "fp32"
    with pytest.raises(ExportError, match="export format 'hif4' is already registered"):
        registry.register_export_format(registry.ExportFormat("hif4", fp32.payload))
    with pytest.raises(ExportError, match=r"unknown export format 'fp33' \(did you mean 'fp32'"):
        check_format("fp33")
