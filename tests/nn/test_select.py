"""``ignore`` entries beyond regexes: blocks by position (``first:N``, ``last:N``,
``last:<fraction>``) and linears by kind, as the field's recipes keep layers in BF16; and
the field's recipes by name, wherever a recipe name is taken."""

from __future__ import annotations

import math

import pytest

import fp4rl
from fp4rl.errors import RecipeError
from fp4rl.gemm import UNQUANTIZED
from fp4rl.models import tiny_model
from fp4rl.nn import fp4_layers, get_recipe
from fp4rl.nn.recipe import field_recipe_names
from fp4rl.rl.config import ConfigError, load_config

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _names(blocks: int) -> list[str]:
    """Every block linear of a Llama of ``blocks`` blocks, written out."""
    return [f"model.layers.{i}.{part}.{leaf}" for i in range(blocks)
            for part, leaves in (("self_attn", ATTENTION),
                                 ("mlp", ("gate_proj", "up_proj", "down_proj")))
            for leaf in leaves]


@pytest.mark.parametrize("entry, blocks, kept", [
    ("first:2", 10, lambda i, leaf: i >= 2),
    ("last:3", 10, lambda i, leaf: i < 7),
    ("last:0.15", 28, lambda i, leaf: i < 28 - math.ceil(0.15 * 28)),  # 5 of 28 in BF16
    ("last:0.15", 36, lambda i, leaf: i < 36 - 6),
    ("kind:attention", 4, lambda i, leaf: leaf not in ATTENTION),
    ("kind:mlp", 4, lambda i, leaf: leaf in ATTENTION),
    ("kind:lm_head", 4, lambda i, leaf: True),
    (r"re:.*layers\.1\..*", 4, lambda i, leaf: i != 1),
])
def test_each_entry_leaves_out_the_linears_it_names(entry, blocks, kept):
    recipe = get_recipe("hif4").replace(ignore=(entry,))
    for name in _names(blocks):
        index, leaf = int(name.split(".")[2]), name.rsplit(".", 1)[1]
        assert recipe.ignores(name, blocks) == (not kept(index, leaf)), name
    assert not recipe.ignores("lm_head", blocks) or entry.startswith("re:")


def test_the_patched_model_counts_its_own_blocks():
    model, _ = tiny_model("llama")
    blocks = model.config.num_hidden_layers
    recipe = get_recipe("hif4").replace(ignore=("last:1", "kind:attention"))
    fp4rl.quantize_model(model, recipe)
    assert sorted(fp4_layers(model)) == sorted(
        n for n in _names(blocks) if not n.startswith(f"model.layers.{blocks - 1}.")
        and n.rsplit(".", 1)[1] not in ATTENTION)


@pytest.mark.parametrize("entry, says", [
    ("first:0", "must be a positive integer"),
    ("last:1.5", r"a positive integer or a fraction in \(0, 1\)"),
    ("last:x", "a positive integer or a fraction"),
    ("kind:head", "choose kind:attention, kind:mlp"),
    ("re:(", "is not a regex"),
])
def test_malformed_entries_are_one_line(entry, says):
    with pytest.raises(RecipeError, match=says):
        get_recipe("hif4").replace(ignore=(entry,))


def test_counting_from_the_end_needs_the_block_count():
    recipe = get_recipe("hif4").replace(ignore=("last:2",))
    with pytest.raises(RecipeError, match="block count is not known"):
        recipe.ignores("model.layers.3.mlp.up_proj")


@pytest.mark.parametrize("name", field_recipe_names())
def test_the_fields_recipes_are_names_and_config_shorthands(name):
    recipe = get_recipe(name)
    dequantized = recipe.train.backward_operands == "dequantized"
    assert dequantized == (recipe.train.gradients is UNQUANTIZED) == (name != "torchao-nvfp4")
    assert recipe.rollout.weights.name.startswith("nvfp4") and recipe.rollout.weights is \
        recipe.train.weights
    assert bool(recipe.ignore) == (name != "torchao-nvfp4")
    assert get_recipe(f"{name}+resq-2:4").rollout.recovery.method == "resq"
    cfg = load_config("smoke", [f"recipe={name}", "rollout.engine=hf"])
    assert cfg.recipe() == recipe and cfg.rollout.engine == "hf"
    with pytest.raises(ConfigError, match=f"recipe={name} sets train.*drop train"):
        load_config(None, [f"recipe={name}", "train.weights=hif4"])


def test_a_recipe_name_in_a_config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("recipe: miles-nvfp4\ngrpo: {batch_size: 4}\n")
    cfg = load_config(path)
    assert cfg.recipe() == get_recipe("miles-nvfp4") and cfg.ignore == ["last:0.15"]
    with pytest.raises(ConfigError, match="recipe: unknown recipe 'miles'"):
        load_config(None, ["recipe=miles"])


@pytest.mark.parametrize("name", ["hif4", "nvfp4_per_token", *field_recipe_names()])
@pytest.mark.parametrize("autocast", [False, True])
def test_where_both_policies_quantize_alike_the_trainer_scores_what_the_rollout_ran(
        name, autocast):
    """Recipes whose training forward and rollout use the same formats (the field's
    recipes: one quantization in trainer and sampler) give bit-identical logits in both
    modes on the same sequence: their Q(W) and Q(X) are the same, so a mismatch the run
    logs comes from how the engine computes (decode against prefill), not the policy."""
    import torch

    model, _ = tiny_model("qwen2", num_hidden_layers=8)  # past nemo-rl's 2 + 4 in BF16
    fp4rl.quantize_model(model, name)
    ids = torch.tensor([[3, 9, 27, 81, 40, 12, 7, 7, 100]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        train = model(input_ids=ids).logits
        with fp4rl.rollout_mode(model):
            rollout = model(input_ids=ids).logits
    assert torch.equal(train, rollout)
