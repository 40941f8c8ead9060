"""The ``vllm`` export format: a Hugging Face directory vLLM serves as fp4rl's rollout policy.

config.json carries ``quantization_config`` = :func:`fp4rl.rollout.vllm.config.quantization_config`
of the rollout recipe, so that vLLM, with fp4rl installed (its ``vllm.general_plugins``
entry point registers the ``fp4rl`` method), quantizes the block linears as fp4rl's rollout
mode does. Writing it needs no vLLM: the config is plain JSON.

The block linears the recipe quantizes are stored as their rollout ``Q(W)`` in the
format's own packed fields (``<layer>.weight_<field>``: the 4-bit codes and the block
scales, each laid out ``[rows, bytes per row]``; NVFP4's per-tensor scale as
``weight_tensor_scale``), computed here from the float32 master weights exactly as fp4rl's
rollout quantizes them: the served policy is the one fp4rl trained against, bit for bit,
in about a quarter of bf16's bytes. The plug-in installs them without re-quantizing.
Every other tensor is bf16.
"""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedModel

from fp4rl.export.directory import Payload, unquantized_tensors
from fp4rl.export.targets import ExportError, block_linears
from fp4rl.gemm import UNQUANTIZED, PackedOperand
from fp4rl.nn.recipe import Recipe, as_recipe, get_recipe
from fp4rl.recovery import make_recovery
from fp4rl.rollout.vllm.config import quantization_config, rollout_recipe

#: the linears vLLM merges into one layer in the model families fp4rl exports (Llama,
#: Qwen2, Mistral: their ``packed_modules_mapping``); an export is checked against it
#: offline, where no vLLM model is at hand (inside an engine the model's own mapping is read)
MERGED_LINEARS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                  "gate_up_proj": ("gate_proj", "up_proj")}

#: the rollout recipe ``fp4rl export --format vllm`` writes when none is given
DEFAULT_VLLM_RECIPE = "hif4+resq-2:4"


#: ``--recipe run``: the rollout recipe of the run a checkpoint comes from
RUN_RECIPE = "run"


def check_takes_recipe(fmt: str) -> None:
    """Refuse a recipe given with an export format other than ``vllm``."""
    if fmt != "vllm":
        raise ExportError(f"--recipe applies to --format vllm only (the rollout recipe vLLM "
                          f"runs); the {fmt} export quantizes what the run trained: drop "
                          "--recipe")


def read_recipe(fmt: str, recipe: str | Recipe | None) -> Recipe | None:
    """The recipe an export's caller gave (a name, read here, or a :class:`Recipe`),
    checked for the vLLM plug-in before any model is loaded (None for none). Refused in
    one line: a recipe with a format other than ``vllm``, ``"run"`` (only a checkpoint's
    export has a run to take it from: :func:`fp4rl.export.export_checkpoint` reads it), a
    recipe the plug-in cannot run. The export's public functions read it once and pass
    the object down."""
    if recipe is None:
        return None
    check_takes_recipe(fmt)
    if recipe == RUN_RECIPE:
        raise ExportError("--recipe run needs --checkpoint (the run whose recipe it "
                          "names); with --model give a recipe name, e.g. hif4+resq-2:4")
    return vllm_recipe(as_recipe(recipe))


def vllm_recipe(recipe: Recipe, run_ignore: Iterable[str] = ()) -> Recipe:
    """``recipe`` (read from its name by the export's public functions) checked for the
    plug-in, with a run's ``ignore`` patterns added to its own (the layers the run left
    unquantized stay so when vLLM serves it)."""
    recipe = rollout_recipe(recipe)
    ignore = tuple(dict.fromkeys((*recipe.ignore, *run_ignore)))
    return recipe.replace(ignore=ignore) if ignore != recipe.ignore else recipe


def default_vllm_recipe() -> Recipe:
    """The recipe of :data:`DEFAULT_VLLM_RECIPE`, checked for the plug-in."""
    return vllm_recipe(get_recipe(DEFAULT_VLLM_RECIPE))


def vllm_payload(model: PreTrainedModel, recipe: Recipe) -> Payload:
    """The block linears ``recipe`` quantizes as their packed ``Q(W)``, the rest in bf16,
    and the ``quantization_config`` that makes vLLM run ``recipe``'s rollout policy."""
    layers = block_linears(model, recipe.ignores_in(n for n, _ in model.named_modules()))
    if not layers:
        raise ExportError(f"{type(model).__name__} has no linear layer inside a transformer "
                          "block for the vLLM plug-in to quantize; export it as bf16")
    check_merged(block_linears(model, lambda name: False), recipe)
    fmt = recipe.rollout.weights
    if fmt is UNQUANTIZED:  # a W16 rollout: the weights are what vLLM runs
        return Payload(unquantized_tensors(model, skip=set()),
                       quantization_config=quantization_config(recipe))
    tensors = unquantized_tensors(model, skip=set(layers))
    for name, layer in layers.items():
        # Q(W) as the rollout takes it (the recovery's weight transform, then the format)
        recovery = make_recovery(recipe.rollout.recovery, recipe.rollout.activations,
                                 layer.in_features, 0, weight_format=fmt)
        packed = recovery.weight_operand(layer.weight.detach().float(), packed=True)
        assert isinstance(packed, PackedOperand)
        for field, value in packed.row_fields().items():
            tensors[f"{name}.weight_{field}"] = value.contiguous()
        if packed.scale is not None:
            tensors[f"{name}.weight_tensor_scale"] = packed.scale.reshape(1).float()
    return Payload(tensors, quantization_config=quantization_config(recipe))


def check_merged(names: Iterable[str], recipe: Recipe) -> None:
    """Refuse an ``ignore`` that splits one of vLLM's merged linears (q/k/v, gate/up):
    vLLM runs them as one layer, quantized or not as a whole."""
    names = list(names)
    ignores = recipe.ignores_in(names)
    groups: dict[str, list[str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        for merged, parts in MERGED_LINEARS.items():
            if leaf in parts:
                groups.setdefault(f"{parent}.{merged}", []).append(name)
    for merged, members in groups.items():
        ignored = [n for n in members if ignores(n)]
        if ignored and len(ignored) < len(members):
            raise ExportError(f"ignore leaves part of vLLM's merged linear {merged} "
                              f"({', '.join(ignored)}) unquantized; vLLM runs it as one "
                              f"layer: ignore all of {', '.join(members)} or none")
