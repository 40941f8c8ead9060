"""Recipes: YAML/dict loading, validation messages, the paper's Table 1 presets."""

from __future__ import annotations

import pytest
import torch

from fp4rl.formats import get_format
from fp4rl.gemm import UNQUANTIZED, quantize_operand
from fp4rl.nn.recipe import Recipe, RecipeError, TrainPrecision, get_recipe, table1_recipes
from fp4rl.recovery import Recovery

FP4_FORMATS = ("hif4", "mxfp4", "nvfp4")


def test_from_yaml(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "model: smollm2-135m\n"
        "train: {weights: hif4, activations: hif4, gradients: hif4}\n"
        "rollout: {weights: hif4, activations: hif4, recovery: {method: resq, sparsity: '2:4'}}\n")
    recipe = Recipe.from_yaml(path)
    assert recipe.train.gradients is get_format("hif4")
    assert recipe.rollout.recovery == Recovery.make("resq", sparsity="2:4")
    assert recipe == get_recipe("hif4+resq-2:4")
    assert Recipe.from_dict(recipe.to_dict()) == recipe


@pytest.mark.parametrize(("data", "message"), [
    ({"train": {"weights": "fp3"}}, r"train\.weights: 'fp3' is not a format; choose one of"),
    ({"rollout": {"activations": 4}}, r"rollout\.activations"),
    ({"train": {"weight": "hif4"}}, r"train: unknown key\(s\) \['weight'\] \(did you mean"),
    ({"rollout": {"recovery": {"method": "magic"}}}, r"unknown recovery method 'magic'"),
    ({"rollout": {"recovery": {"method": "resqq"}}}, r"did you mean 'resq'\?"),
    ({"rollout": {"recovery": {"method": "resq", "alpha": 0.3}}},
     r"method 'resq' takes sparsity; 'alpha' belongs to smoothquant"),
    ({"rollout": {"recovery": {"method": "smoothquant", "alpah": 0.3}}},
     r"did you mean 'alpha'\?"),
    ({"rollout": {"recovery": {"method": "smoothquant", "alpha": "high"}}},
     r"alpha: expected float"),
    ({"rollout": {"recovery": {"method": "rht", "fresh_signs": 1}}}, r"expected bool"),
    ({"train": {"weights": "hif5"}}, r"did you mean 'hif4'\?"),
    ({"ignore": ["(unclosed"]}, r"ignore: '\(unclosed' is not a regex"),
    ({"rollout": {"recovery": {"method": "resq", "sparsity": "3:2"}}}, r"n:m"),
    ({"rollout": {"recovery": {"method": "rht", "block_size": 48}}}, r"power of two"),
    ({"rollout": {"recovery": {"method": "occ", "quantile": 1.5}}}, r"quantile"),
    ({"rollout": {"recovery": {"method": "smoothquant", "alpha": -1}}}, r"alpha"),
    ({"policy": {}}, r"recipe: unknown key"),
    (["hif4"], r"must be a mapping"),
])
def test_validation_messages(data, message):
    with pytest.raises(ValueError, match=message):
        Recipe.from_dict(data)


@pytest.mark.parametrize("fmt", FP4_FORMATS)
def test_table1_recipes(fmt):
    names = table1_recipes(fmt)
    assert len(names) == 10  # BF16/BF16 + FP4 x 5 rollouts + BF16 x 4 FP4-ish rollouts
    cells = {n: get_recipe(n) for n in names}
    f = get_format(fmt)
    assert cells[f"{fmt}:fp4/bf16"].train.weights is f
    assert cells[f"{fmt}:fp4/bf16"].rollout.weights is UNQUANTIZED
    assert (cells[f"{fmt}:fp4/w4a16"].rollout.weights,
            cells[f"{fmt}:fp4/w4a16"].rollout.activations) == (f, UNQUANTIZED)
    assert cells[f"{fmt}:fp4/w4a8"].rollout.activations is get_format("mxfp8_e4m3")
    assert cells[f"{fmt}:fp4/w16a4"].rollout.weights is UNQUANTIZED
    assert cells[f"{fmt}:bf16/fp4"].train.activations is UNQUANTIZED
    assert cells[f"{fmt}:bf16/fp4"].rollout.activations is f
    assert get_recipe(fmt) == cells[f"{fmt}:fp4/fp4"]
    assert {r.train.backward_operands for r in cells.values()} == {"requantize"}
    # beyond Table 1: FP4 training with the HiFloat4 authors' simulated backward
    reuse = get_recipe(f"{fmt}:fp4-reuse/bf16+resq-2:4")
    assert reuse.train == cells[f"{fmt}:fp4/bf16"].train.replace(
        backward_operands="reuse_forward")
    assert reuse.rollout.weights is UNQUANTIZED and reuse.rollout.recovery.method == "resq"
    with pytest.raises(RecipeError, match="fp4-reuse"):
        get_recipe(f"{fmt}:fp4-reused/bf16")


@pytest.mark.parametrize(("name", "label"), [
    ("hif4+resq-2:4", "resq-2:4"), ("mxfp4+resq-dense", "resq-dense"),
    ("hif4+resq-channel:0.5", "resq-channel:0.5"), ("hif4+resq-block:32x64:0.5",
                                                    "resq-block:32x64:0.5"),
    ("hif4+smoothquant", "smoothquant"), ("hif4+rht", "rht"), ("nvfp4+occ", "occ"),
    ("hif4", ""),
])
def test_recovery_suffixes(name, label):
    assert get_recipe(name).rollout.recovery.label == label


@pytest.mark.parametrize("bad", ["fp4", "hif4:fp8/fp4", "hif4:fp4/w2a2", "hif4+magic",
                                 "hif4+rht-3"])
def test_bad_presets(bad):
    with pytest.raises(RecipeError):
        get_recipe(bad)


def test_a_per_token_format_scales_activations_and_gradients_never_weights():
    """nvfp4_per_token's scales lie along the tokens; a GEMM keeps them outside only along
    its other axis, so the recipe named after it gives the weights NVFP4's per-tensor
    scale, and a recipe that puts it on a weight, or multiplies Q(X) along its tokens
    (reuse_forward), is refused with what to use instead."""
    r = get_recipe("nvfp4_per_token+resq-2:4")
    assert tuple(map(str, (r.train.weights, r.train.activations, r.train.gradients))) == \
        ("nvfp4", "nvfp4_per_token", "nvfp4_per_token")
    assert tuple(map(str, (r.rollout.weights, r.rollout.activations))) == \
        ("nvfp4", "nvfp4_per_token")
    with pytest.raises(RecipeError, match=r"rollout\.weights: nvfp4_per_token .* use nvfp4"):
        Recipe.from_dict({"rollout": {"weights": "nvfp4_per_token"}})
    with pytest.raises(RecipeError, match=r"train\.weights"):
        TrainPrecision(weights="nvfp4_per_token", activations="nvfp4_per_token",
                       gradients="nvfp4_per_token")
    with pytest.raises(RecipeError, match="requantize"):
        get_recipe("nvfp4_per_token:fp4-reuse/fp4")


def test_not_quantized_is_none_and_a_typed_bf16_reads_as_it():
    """``none`` leaves an operand as it is (FP32 stays FP32); ``bf16`` typed in a recipe
    reads as ``none``, while the number format ``bf16`` rounds."""
    assert TrainPrecision(weights="BF16").weights is UNQUANTIZED
    assert str(UNQUANTIZED) == "none"
    recipe = Recipe.from_dict({"rollout": {"weights": "bf16", "activations": "none"}})
    assert recipe == Recipe() == get_recipe("bf16")
    assert recipe.to_dict()["rollout"]["weights"] == "none"
    x = torch.randn(8, 64, dtype=torch.float32)
    assert quantize_operand(x, UNQUANTIZED).values is x
    rounded = quantize_operand(x, get_format("bf16")).dense()
    assert torch.equal(rounded, x.bfloat16().float()) and not torch.equal(rounded, x)
    with pytest.raises(RecipeError, match=r"choose one of none, hif4.*\(bf16 reads as none\)"):
        TrainPrecision(gradients="fp16")


def test_a_recipe_holds_the_registered_format_objects_through_copies_and_pickles():
    """Operands hold the registry's format objects (not their names): a copy, a deep
    copy and a pickle round trip keep the same objects, and the YAML form is the names."""
    import copy
    import pickle

    recipe = get_recipe("nvfp4_per_token:fp4/w4a16+resq-2:4")
    assert recipe.train.weights is get_format("nvfp4")
    assert recipe.train.activations is get_format("NVFP4_PER_TOKEN")
    assert recipe.rollout.activations is UNQUANTIZED
    for again in (copy.copy(recipe), copy.deepcopy(recipe), pickle.loads(pickle.dumps(recipe))):
        assert again == recipe and again.train.weights is recipe.train.weights
        assert again.rollout.activations is UNQUANTIZED
    assert recipe.to_dict()["train"] == {
        "weights": "nvfp4", "activations": "nvfp4_per_token", "gradients": "nvfp4_per_token",
        "stochastic_gradients": False, "backward_operands": "requantize",
        "wgrad_hadamard": "off"}
    assert TrainPrecision(weights=get_format("hif4")) == TrainPrecision(weights="HiF4")


def test_resq_on_unquantized_activations_leaves_them_as_they_are():
    """W4A16 + ResQ: nothing quantizes the activations, so there is no residual and the
    rollout is W4A16's, bit for bit, in fp32 and bf16."""
    from fp4rl.nn import FP4Linear, Mode

    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 32)
    x = torch.randn(5, 128)
    outputs = []
    for name in ("hif4:fp4/w4a16", "hif4:fp4/w4a16+resq-2:4"):
        layer = FP4Linear.from_linear(linear, get_recipe(name))
        layer.mode = Mode.ROLLOUT
        with torch.no_grad():
            outputs.append((layer(x), layer(x.bfloat16())))
    assert all(torch.equal(a, b) for a, b in zip(*outputs, strict=True))


def test_a_format_object_no_registry_holds_pickles_by_value():
    """Only the registered object travels as its name: another object of the same class
    comes back as a copy of itself, not as the registry's."""
    import pickle

    from fp4rl.formats.hif4 import HiF4

    own = HiF4()
    assert own is not get_format("hif4")
    again = pickle.loads(pickle.dumps(own))
    assert again is not get_format("hif4") and type(again) is HiF4 and again.name == own.name
    assert pickle.loads(pickle.dumps(get_format("hif4"))) is get_format("hif4")
