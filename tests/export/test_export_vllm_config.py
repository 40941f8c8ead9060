"""``fp4rl export --format vllm``: what the directory holds, checked without vLLM (vLLM
serving it is tests/vllm_engine/test_export_vllm.py)."""

from __future__ import annotations

import json

import pytest
import torch
from test_export import stored_tensors
from torch import nn

from fp4rl.cli import main
from fp4rl.errors import ConfigError
from fp4rl.export import ExportError, export_model
from fp4rl.formats import get_format
from fp4rl.gemm import PackedOperand, quantize_operand
from fp4rl.integrations.vllm import VLLMError, quantization_config
from fp4rl.models import load_model, tiny_model
from fp4rl.nn.recipe import Recipe, get_recipe
from fp4rl.rl import checkpoint as ckpt
from fp4rl.rl.config import load_config
from fp4rl.rollout.vllm.config import RefitWire, WeightStorage
from fp4rl.rollout.vllm.settings import VLLMSettings

HIF4 = get_format("hif4")


def config_of(directory) -> dict:
    return json.loads((directory / "config.json").read_text())


def block_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.weight": m.weight.detach() for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and ".layers." in name}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_vllm_export_packed_block_linears_and_quantization_config(tmp_path, arch):
    """The block linears as the packed codes and scales of their rollout Q(W) (decoding
    them gives fp4rl's own rollout operand, bit for bit), the rest in bf16."""
    model, tok = tiny_model(arch, seed=3)
    result = export_model(model, tok, "vllm", tmp_path / "out")
    config = config_of(tmp_path / "out")
    assert config["quantization_config"] == quantization_config("hif4+resq-2:4")
    assert config["quantization_config"]["quant_method"] == "fp4rl"
    assert config["quantization_config"]["rollout"]["recovery"] == {"method": "resq",
                                                                    "sparsity": "2:4"}
    tensors = stored_tensors(tmp_path / "out")
    blocks = block_weights(model)
    assert blocks
    for name, w in blocks.items():
        assert name not in tensors
        fields = {k.rpartition(".weight_")[2]: v for k, v in tensors.items()
                  if k.startswith(f"{name}_")}
        assert set(fields) == {"scale", "level2", "level3", "codes"}, name
        assert all(v.dtype == torch.uint8 and v.shape[0] == w.shape[0] for v in fields.values())
        decoded = PackedOperand.from_row_fields(HIF4, tuple(w.shape), fields).decode()
        assert torch.equal(decoded.values, quantize_operand(w, HIF4).values), name
    for name, t in tensors.items():
        if ".weight_" not in name:
            assert t.dtype == torch.bfloat16, name
    assert "lm_head.weight" not in tensors  # tied, stored once
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= files
    assert result.format == "vllm" and "packed" in result.summary()
    assert result.ratio < 0.5  # a tiny model's embeddings weigh more than a real one's


def test_vllm_export_recipe_and_ignore(tmp_path):
    model, tok = tiny_model("llama")
    recipe = Recipe.from_dict({**get_recipe("nvfp4+resq-channel:0.5").to_dict(),
                               "ignore": ["re:.*\\.1\\.mlp\\.down_proj"]})
    export_model(model, tok, "vllm", tmp_path / "out", recipe=recipe)
    config = config_of(tmp_path / "out")["quantization_config"]
    assert config == quantization_config(recipe)
    assert config["rollout"]["weights"] == "nvfp4"
    assert config["ignore"] == [".*\\.1\\.mlp\\.down_proj"]
    tensors = stored_tensors(tmp_path / "out")
    assert tensors["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.down_proj.weight" not in tensors
    scale = tensors["model.layers.0.mlp.down_proj.weight_tensor_scale"]  # NVFP4's, outside
    w = model.model.layers[0].mlp.down_proj.weight.detach()
    assert scale.dtype == torch.float32
    assert torch.equal(scale, quantize_operand(w, get_format("nvfp4")).scale.reshape(1))


@pytest.mark.parametrize("recipe", ["hif4+smoothquant", "hif4+resqw-2:4", "mxfp4+occ"])
def test_recipes_the_plugin_refuses(tmp_path, recipe):
    model, tok = tiny_model("llama")
    with pytest.raises(VLLMError, match="cannot run inside vLLM"):
        export_model(model, tok, "vllm", tmp_path / "out", recipe=recipe)
    assert not (tmp_path / "out").exists()


def test_ignore_splitting_a_merged_linear_is_refused(tmp_path):
    model, tok = tiny_model("llama")
    recipe = Recipe.from_dict({**get_recipe("hif4").to_dict(),
                               "ignore": ["re:.*\\.0\\.mlp\\.up_proj"]})
    with pytest.raises(ExportError, match=r"merged linear model\.layers\.0\.mlp\.gate_up_proj"):
        export_model(model, tok, "vllm", tmp_path / "out", recipe=recipe)


def cli_error(capsys, *args: str) -> str:
    assert main(["export", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fp4rl export: error:") and err[-1].count("error") == 1
    return err[-1]


def test_cli_vllm_export_and_refusals(tmp_path, capsys, tiny_llama_dir):
    out = tmp_path / "out"
    assert main(["export", "--model", str(tiny_llama_dir), "--format", "vllm",
                 "--recipe", "mxfp4", "--output", str(out)]) == 0
    assert "vllm export in" in capsys.readouterr().out
    assert config_of(out)["quantization_config"] == quantization_config("mxfp4")
    bad = tmp_path / "bad"
    for recipe in ("hif4+smoothquant", "hif4+resqw-2:4"):
        err = cli_error(capsys, "--model", str(tiny_llama_dir), "--format", "vllm",
                        "--recipe", recipe, "--output", str(bad))
        assert "cannot run inside vLLM" in err
    err = cli_error(capsys, "--model", str(tiny_llama_dir), "--format", "hif4",
                    "--recipe", "hif4", "--output", str(bad))
    assert "--recipe applies to --format vllm only" in err
    err = cli_error(capsys, "--model", str(tiny_llama_dir), "--format", "vllm",
                    "--recipe", "run", "--output", str(bad))
    assert "--recipe run needs --checkpoint" in err
    assert not bad.exists()


def test_cli_vllm_export_of_a_run(tmp_path, capsys, tiny_llama_dir):
    model, _ = load_model(str(tiny_llama_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    cfg = load_config(None, [f"model={tiny_llama_dir}", "rollout.weights=mxfp4",
                             "rollout.activations=mxfp4",
                             "ignore=['re:.*\\.0\\.mlp\\.down_proj']"])
    run = tmp_path / "run"
    ckpt.save_checkpoint(run, 1, model, torch.optim.AdamW(model.parameters()),
                         {"step": 1, "config": cfg.model_dump()})
    assert main(["export", "--checkpoint", str(run), "--format", "vllm", "--recipe", "run",
                 "--output", str(tmp_path / "own")]) == 0
    config = config_of(tmp_path / "own")["quantization_config"]
    assert config["rollout"]["weights"] == "mxfp4" and config["rollout"]["activations"] == "mxfp4"
    assert config["ignore"] == [".*\\.0\\.mlp\\.down_proj"]
    # a preset keeps the run's ignore: what the run left unquantized stays so
    assert main(["export", "--checkpoint", str(run), "--format", "vllm",
                 "--output", str(tmp_path / "preset")]) == 0
    config = config_of(tmp_path / "preset")["quantization_config"]
    assert config["rollout"]["recovery"]["method"] == "resq"
    assert config["ignore"] == [".*\\.0\\.mlp\\.down_proj"]
    tensors = stored_tensors(tmp_path / "preset")
    for name, w in block_weights(model).items():  # the run's trained weights, as exported
        if name == "model.layers.0.mlp.down_proj.weight":
            assert torch.equal(tensors[name], w.to(torch.bfloat16))
        else:
            codes = PackedOperand.from_row_fields(
                HIF4, tuple(w.shape), {f: tensors[f"{name}_{f}"] for f in
                                       ("scale", "level2", "level3", "codes")})
            assert torch.equal(codes.decode().values, quantize_operand(w, HIF4).values)


def test_a_run_that_rolled_out_in_vllm_evaluates_and_exports_in_every_format(
        tmp_path, capsys, tiny_llama_dir):
    """``rollout.engine`` and ``rollout.vllm`` say how a run rolled out, not what policy it
    ran: every reader of the saved config takes them (the recipe leaves them out)."""
    from fp4rl.export import EXPORT_FORMATS
    from fp4rl.rl.sources import load_trained

    model, _ = load_model(str(tiny_llama_dir))
    cfg = load_config(None, [f"model={tiny_llama_dir}", "rollout.engine=vllm",
                             "rollout.vllm={weight_storage: packed}"])
    run = tmp_path / "run"
    ckpt.save_checkpoint(run, 1, model, torch.optim.AdamW(model.parameters()),
                         {"step": 1, "config": cfg.model_dump()})
    assert load_trained(run).recipe == cfg.recipe()
    for recipe in ([], ["--recipe", "run"]):
        assert main(["eval", "--checkpoint", str(run), "--n", "2", *recipe]) == 0
    assert "mismatch" not in capsys.readouterr().out  # the run kept no metrics
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "mismatch/gen_kl_error": 0.2,
                                                   "mismatch/token_mult_prob_error": 1.1}))
    assert main(["eval", "--checkpoint", str(run / "checkpoints" / "step-000001"),
                 "--n", "2"]) == 0
    assert ("token_mult_prob_error 1.1 (within NeMo-RL's < 1.15); gen_kl_error 0.2 (over "
            "NeMo-RL's < 0.1)") in " ".join(capsys.readouterr().out.split())  # unwrapped
    for fmt in EXPORT_FORMATS:
        assert main(["export", "--checkpoint", str(run), "--format", fmt,
                     "--output", str(tmp_path / fmt)]) == 0, capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"rollout\.vllm: unknown key"):
        load_config(None, [VLLM, "rollout.vllm={storage: packed}"])


VLLM = "rollout.engine=vllm"


@pytest.mark.parametrize("key", ["kv_cache_bytes", "refit_piece_bytes"])
@pytest.mark.parametrize("value", ["0", "-5", "1.5", "lots"])
def test_the_engines_byte_sizes_are_positive_numbers_of_bytes(key, value):
    with pytest.raises(ConfigError, match=rf"rollout\.vllm\.{key} must be a positive"):
        load_config(None, [VLLM, f"rollout.vllm.{key}={value}"])
    cfg = load_config(None, [VLLM, f"rollout.vllm.{key}=268435456"])
    assert getattr(cfg.rollout.settings_of("vllm"), key) == 1 << 28


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2", "most"])
def test_the_engines_gpu_share_lies_in_zero_one(value):
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be a share"):
        load_config(None, [VLLM, f"rollout.vllm.gpu_memory_utilization={value}"])
    cfg = load_config(None, [VLLM, "rollout.vllm.gpu_memory_utilization=0.5"])
    assert cfg.rollout.settings_of("vllm").gpu_memory_utilization == 0.5


@pytest.mark.parametrize("overrides, says", [
    (["rollout.vllm.kv_cache_bytes=268435456"],
     r"rollout\.vllm configures the vllm engine, and rollout\.engine=hf runs another"),
    ([VLLM, "distributed.strategy=fsdp", "rollout.vllm.weight_storage=packed"],
     r"distributed\.strategy=fsdp .* use weight_storage=dequantized, or ddp"),
    ([VLLM, "rollout.vllm.weight_storage=packed", "rollout.vllm.refit_wire=bf16"],
     r"set rollout\.vllm\.refit_wire=packed"),
    ([VLLM, "rollout.vllm=5"], r"rollout\.vllm must be a mapping of settings"),
    ([VLLM, "rollout.vllm.weight_storage=fp32"],
     r"rollout\.vllm\.weight_storage must be dequantized or packed, got 'fp32'"),
])
def test_settings_no_run_could_use_are_refused_at_config_time(overrides, says):
    """Combinations that would pass and then fail inside the engine, or be ignored, are
    one line before anything loads."""
    with pytest.raises(ConfigError, match=says):
        load_config(None, overrides)


def test_each_engine_is_given_its_own_settings_only():
    cfg = load_config(None, [VLLM, "rollout.vllm.refit_wire=bf16",
                             "distributed.strategy=fsdp"])
    vllm = cfg.rollout.settings_of("vllm")
    assert isinstance(vllm, VLLMSettings)  # a typed section, its enums as members
    assert vllm.refit_wire is RefitWire.BF16 and vllm.weight_storage is WeightStorage.DEQUANTIZED
    assert cfg.rollout.settings_of("hf") is None
