"""``fp4rl export --format vllm``: what the directory holds, checked without vLLM (vLLM
serving it is tests/vllm_engine/test_export_vllm.py)."""

from __future__ import annotations

import json

import pytest
import torch
from test_export import stored_tensors
from torch import nn

from fp4rl.cli import main
from fp4rl.export import ExportError, export_model
from fp4rl.integrations.vllm import VLLMError, quantization_config
from fp4rl.models import load_model, tiny_model
from fp4rl.nn.recipe import Recipe, preset
from fp4rl.rl import checkpoint as ckpt
from fp4rl.rl.config import load_config


def config_of(directory) -> dict:
    return json.loads((directory / "config.json").read_text())


def block_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.weight": m.weight.detach() for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and ".layers." in name}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_vllm_export_float32_block_linears_and_quantization_config(tmp_path, arch):
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
    for name, w in blocks.items():  # the float32 masters, bit for bit
        assert tensors[name].dtype == torch.float32 and torch.equal(tensors[name], w), name
    for name, t in tensors.items():
        if name not in blocks:
            assert t.dtype == torch.bfloat16, name
    assert "lm_head.weight" not in tensors  # tied, stored once
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= files
    assert result.format == "vllm" and "float32" in result.summary()


def test_vllm_export_recipe_and_ignore(tmp_path):
    model, tok = tiny_model("llama")
    recipe = Recipe.from_dict({**preset("nvfp4+resq-channel:0.5").to_dict(),
                               "ignore": ["re:.*\\.1\\.mlp\\.down_proj"]})
    export_model(model, tok, "vllm", tmp_path / "out", recipe=recipe)
    config = config_of(tmp_path / "out")["quantization_config"]
    assert config == quantization_config(recipe)
    assert config["rollout"]["weights"] == "nvfp4"
    assert config["ignore"] == [".*\\.1\\.mlp\\.down_proj"]
    tensors = stored_tensors(tmp_path / "out")
    assert tensors["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32


@pytest.mark.parametrize("recipe", ["hif4+smoothquant", "hif4+resqw-2:4", "mxfp4+occ"])
def test_recipes_the_plugin_refuses(tmp_path, recipe):
    model, tok = tiny_model("llama")
    with pytest.raises(VLLMError, match="cannot run inside vLLM"):
        export_model(model, tok, "vllm", tmp_path / "out", recipe=recipe)
    assert not (tmp_path / "out").exists()


def test_ignore_splitting_a_merged_linear_is_refused(tmp_path):
    model, tok = tiny_model("llama")
    recipe = Recipe.from_dict({**preset("hif4").to_dict(), "ignore": ["re:.*\\.0\\.mlp\\.up_proj"]})
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
    for name, w in block_weights(model).items():
        want = w.to(torch.bfloat16) if name == "model.layers.0.mlp.down_proj.weight" else w
        assert torch.equal(tensors[name], want), name
