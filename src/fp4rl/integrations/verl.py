"""fp4rl inside verl: FP4 training for verl's actor, and the FP4 rollout in verl's vLLM.

verl (the paper's own framework) has no HiF4 and no Rollout-ResQ; it offers the two hooks
this module uses:

- ``actor_rollout_ref.model.external_lib=fp4rl.integrations.verl``: verl imports the
  module in every worker before it builds a model. On import, the module wraps verl's
  ``FSDPEngine._build_module`` so that the actor's Hugging Face model, once built and
  before FSDP wraps it, has its linears replaced by fp4rl's FP4 layers
  (:func:`fp4_actor`; all three GEMMs in the training format, weights left in verl's
  FP32). The reference model (``forward_only``) and a critic (verl's ``value_model``)
  are left as verl builds them. verl's FSDP casts parameters to ``mixed_precision.
  param_dtype`` (bf16 unless set) for the forward, which would make the FP4 GEMMs quantize
  ``bf16(W)`` instead of the FP32 masters: the hook refuses that in one line, and the
  recipe sets ``fsdp_config.mixed_precision.param_dtype=fp32`` (:func:`hydra_overrides`).
  verl autocasts its ``forward_step`` to that dtype, so the hook also sets the actor's
  autocast dtype to bf16 once FSDP wraps it (:func:`wrap_fsdp_build`): FP32 masters and
  optimizer, bf16 compute, as in fp4rl's trainer. FSDP1 (verl's default strategy) is
  refused in one line; the recipe sets ``actor.strategy=fsdp2``.
- ``+actor_rollout_ref.rollout.engine_kwargs.vllm.quantization=fp4rl`` with
  ``hf_overrides`` naming the rollout recipe (:func:`engine_kwargs`): verl passes the
  engine arguments to vLLM last, so they select fp4rl's quantization method, which vLLM
  finds through fp4rl's ``vllm.general_plugins`` entry point in every vLLM process. Leave
  verl's own ``rollout.quantization`` unset (it accepts fp8 and torchao only).

Each step verl sends the actor's FP32 weights to vLLM in buckets through
``model.load_weights`` and then calls ``process_weights_after_loading`` once; the fp4rl
method stages each weight in the precision it arrives in and quantizes it there, so the
engine holds ``Q(W)`` of the FP32 masters, as fp4rl's own refit gives
(``tests/vllm_engine/test_verl_sync.py``).

The actor's recipe comes from the environment variable ``FP4RL_RECIPE``, which reaches
verl's Ray workers through ``+ray_kwargs.ray_init.runtime_env.env_vars.FP4RL_RECIPE=...``:
:func:`hydra_overrides` writes it and the engine's ``quantization_config`` from one recipe
(a name or a :class:`Recipe` built in code, carried as its JSON), so the actor trains the
recipe the engine rolls out. An actor without the variable is refused in one line rather
than trained in some default recipe, and where it is set, an engine whose rollout differs
from it stops when vLLM reads its config (:func:`check_actor_recipe`).
``python -m fp4rl.integrations.verl --recipe R`` prints the overrides for a recipe.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import shlex
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypedDict

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from fp4rl.errors import UserError
from fp4rl.nn import quantize_model
from fp4rl.nn.recipe import Recipe, get_recipe
from fp4rl.precision import compute_dtype
from fp4rl.rollout.vllm.config import (
    QUANT_METHOD,
    QuantizationEntry,
    WeightStorage,
    quantization_config,
)
from fp4rl.rollout.vllm.host import RECIPE_ENV, actor_recipe, encode_recipe

#: the paper's recipe (HiF4 training and rollout, Rollout-ResQ with 2:4 sparsity): what
#: ``python -m fp4rl.integrations.verl`` prints the overrides for without ``--recipe``
DEFAULT_RECIPE = "hif4+resq-2:4"
#: the verl releases whose sources the hook follows (``FSDPEngine._build_module``,
#: ``engine_kwargs.vllm`` passed last, ``load_weights`` then
#: ``process_weights_after_loading`` at each sync): 0.8.0 and 0.9.x
SUPPORTED_VERL = SpecifierSet(">=0.8.0,<0.10")
#: the class whose model-building method the hook wraps
ENGINE_CLASS = "verl.workers.engine.fsdp.transformer_impl.FSDPEngine"
#: verl's engine factory, guarded so that an actor built by another engine stops the run
REGISTRY_CLASS = "verl.workers.engine.base.EngineRegistry"
#: verl's factory of weight-sync backends (0.9), guarded against those that cast
SYNC_REGISTRY = ("verl.checkpoint_engine.base", "CheckpointEngineRegistry")
#: verl 0.9.1's sync backends that cast the actor's weights to the rollout dtype before
#: they reach vLLM: the engine would hold Q(bf16(W)) while the trainer multiplies Q(W)
CASTING_SYNC_BACKENDS = ("delta_sharded", "kimi", "mooncake")
SYNC_BACKEND = "actor_rollout_ref.rollout.checkpoint_engine.backend"


class EngineConfig(Protocol):
    """What fp4rl reads of a verl engine's config (verl's dataclass, or its OmegaConf node):
    ``forward_only``; ``strategy`` and ``mixed_precision`` are read where present."""

    forward_only: bool


class Engine(Protocol):
    """What fp4rl reads and sets of a verl engine (``FSDPEngine`` and the engines its
    factory builds): its config, and the dtype its ``forward_step`` autocasts to."""

    engine_config: EngineConfig
    _autocast_dtype: torch.dtype


#: the arguments a wrapped verl method takes after its engine
_Args = ParamSpec("_Args")


def recipe_from_env() -> Recipe:
    """The actor's recipe ``FP4RL_RECIPE`` holds (its JSON, or a recipe name); refused in
    one line where it is unset: the engine rolls out the recipe of its
    ``quantization_config``, and an actor trained in another would make two policies."""
    return actor_recipe(required=True)


def fp4_actor(module: torch.nn.Module, recipe: Recipe | str) -> torch.nn.Module:
    """verl's freshly built actor ``module`` with fp4rl's FP4 layers (train mode: the
    forward and both backward GEMMs in the recipe's training format). Parameters are
    shared, so names, the state dict verl syncs to vLLM, and FSDP wrapping work as
    before. Which models get them is :func:`is_fp4_actor`'s call."""
    low = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()
                  if p.dtype != torch.float32 and p.is_floating_point()})
    if low:
        warnings.warn(f"fp4rl: verl's actor holds {', '.join(low)} weights; FP4 training "
                      "keeps FP32 masters: leave actor_rollout_ref.actor.fsdp_config."
                      "model_dtype at fp32", RuntimeWarning, stacklevel=2)
    # verl shards the actor (FSDP2): its unsharded weight lives for one GEMM, so the layers
    # do not keep Q(W) between GEMMs (docs/layers.md, weight_cache)
    quantize_model(module, recipe, weight_cache=False)
    return module


#: the override that keeps verl's FSDP from casting the actor's parameters to bf16
FP32_PARAMS = "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32"
#: the override that picks FSDP2 for the actor (and the reference, which follows it);
#: verl's default, ``fsdp``, is FSDP1, which the FP4 actor is not built and tested under
FSDP2 = "actor_rollout_ref.actor.strategy=fsdp2"


def is_fp4_actor(engine: Engine) -> bool:
    """Whether verl's ``engine`` builds the policy that trains (not the reference policy,
    which only computes log-probs, and not a critic, whose value head is no policy)."""
    if engine.engine_config.forward_only:
        return False
    model_config = getattr(engine, "model_config", None)
    return getattr(model_config, "model_type", "language_model") == "language_model"


def check_param_dtype(engine_config: EngineConfig) -> None:
    """Refuse an FSDP mixed precision that casts the actor's parameters below FP32: the FP4
    GEMMs would quantize ``bf16(W)`` while the rollout quantizes the FP32 masters."""
    mixed = getattr(engine_config, "mixed_precision", None) or {}
    dtype = str(mixed.get("param_dtype", "bf16"))  # verl's default when unset
    if dtype not in ("fp32", "float32", "torch.float32"):
        raise UserError(f"fp4rl: verl's FSDP would cast the FP4 actor's parameters to {dtype} "
                        f"(mixed_precision.param_dtype); FP4 training quantizes the FP32 "
                        f"masters: add {FP32_PARAMS}")


def check_strategy(engine_config: EngineConfig) -> None:
    """Refuse verl's FSDP1 (``strategy=fsdp``, verl's default) for the FP4 actor: FSDP1
    flattens parameters into views of one buffer per unit, and the FP4 layers (whose
    tests, and verl's own engine build in ``make test-verl``, run FSDP2) are not held to
    that; FSDP2 shards each parameter as it is."""
    strategy = str(getattr(engine_config, "strategy", None) or "fsdp")
    if strategy != "fsdp2":
        raise UserError(f"fp4rl: verl's actor strategy {strategy!r} is FSDP1, which the FP4 "
                        f"actor is not tested under: set {FSDP2}")


#: the functions fp4rl put in verl's place (the actor's builds, the factories' ``new``): a
#: second install leaves them as they are, and the factory guard tells a hooked engine by them
INSTALLED: weakref.WeakSet[Callable[..., object]] = weakref.WeakSet()


def wrap_build(build: Callable[[Engine], torch.nn.Module],
               recipe: Callable[[], Recipe] = recipe_from_env
               ) -> Callable[[Engine], torch.nn.Module]:
    """``build`` (an engine's ``_build_module``) followed by :func:`fp4_actor` where the
    engine builds the training policy (:func:`is_fp4_actor`), after checking that verl's
    FSDP is FSDP2 (:func:`check_strategy`) and keeps its parameters in FP32
    (:func:`check_param_dtype`)."""

    @functools.wraps(build)
    def build_fp4(engine: Engine) -> torch.nn.Module:
        actor = is_fp4_actor(engine)
        if actor:
            check_strategy(engine.engine_config)
            check_param_dtype(engine.engine_config)
        module = build(engine)
        return fp4_actor(module, recipe()) if actor else module

    INSTALLED.add(build_fp4)
    return build_fp4


#: what the FP4 actor computes in under verl's ``forward_step`` (fp4rl's bf16 mixed
#: precision): FP4 operands are exact in bf16, and flash-attention takes nothing wider
COMPUTE_DTYPE = compute_dtype("bf16")


def wrap_fsdp_build(build: Callable[Concatenate[Engine, _Args], torch.nn.Module]
                    ) -> Callable[Concatenate[Engine, _Args], torch.nn.Module]:
    """``build`` (an engine's ``_build_fsdp_module``) followed, for the FP4 actor, by
    verl's autocast dtype set to bf16. verl autocasts ``forward_step`` to its FSDP
    ``param_dtype``, and skips autocast where that is fp32, which FP4 training needs for
    its masters: the actor would then compute attention, norms, the LM head and its FP4
    GEMMs in fp32 (which flash-attention refuses, and which doubles every activation).
    With this, parameters and the optimizer stay FP32 and the forward computes in bf16,
    as in fp4rl's own trainer."""

    @functools.wraps(build)
    def build_fp4(engine: Engine, *args: _Args.args, **kwargs: _Args.kwargs
                  ) -> torch.nn.Module:
        module = build(engine, *args, **kwargs)
        if is_fp4_actor(engine):
            engine._autocast_dtype = COMPUTE_DTYPE
        return module

    INSTALLED.add(build_fp4)
    return build_fp4


def guard_registry(registry: type) -> None:
    """Make ``registry.new`` (verl's engine factory) refuse, in one line, a training policy
    that an engine without the FP4 hook builds (Megatron, say): the hook would never fire,
    and the actor would train in verl's own precision without a word."""
    def checked(new: Callable[..., Engine], model_type: str, backend: str, *args: object,
                **kwargs: object) -> Engine:
        engine = new(model_type, backend, *args, **kwargs)
        hooked = getattr(type(engine), "_build_module", None) in INSTALLED
        if is_fp4_actor(engine) and not hooked:
            raise UserError(f"fp4rl: verl builds the actor with {type(engine).__name__} "
                            f"(backend {backend!r}), which the FP4 actor hook does not wrap "
                            f"({ENGINE_CLASS}): set {FSDP2}")
        return engine

    _wrap_new(registry, checked)


def _wrap_new(registry: type, around: Callable[..., object]) -> None:
    """Replace a verl factory's ``registry.new`` once by ``around(new, *args, **kwargs)``."""
    # verl's factory method, which mypy cannot know a class to have
    new: Callable[..., object] = getattr(registry, "new")  # noqa: B009
    if new in INSTALLED:
        return

    @functools.wraps(new)
    def guarded(*args: object, **kwargs: object) -> object:
        return around(new, *args, **kwargs)

    INSTALLED.add(guarded)
    setattr(registry, "new", staticmethod(guarded))  # noqa: B010


def check_sync_backend(backend: str) -> None:
    """Refuse, in one line, a weight-sync backend that casts the FP32 masters before vLLM
    quantizes them (:data:`CASTING_SYNC_BACKENDS`), where an FP4 recipe is set
    (``FP4RL_RECIPE``): the rollout would quantize another weight than the trainer, with
    no error anywhere."""
    if backend in CASTING_SYNC_BACKENDS and os.environ.get(RECIPE_ENV):
        raise UserError(f"fp4rl: verl's weight sync {backend!r} casts the actor's FP32 "
                        "weights to the rollout dtype, so vLLM would quantize bf16(W) while "
                        f"the FP4 trainer quantizes W: set {SYNC_BACKEND}=naive (or nccl, "
                        "nixl, which send them as they are)")


def guard_sync_registry(registry: type) -> None:
    """Make ``registry.new`` (verl's sync-backend factory, called in the actor's worker
    after it built the actor) run :func:`check_sync_backend` first."""
    def checked(new: Callable[..., object], backend: str, *args: object, **kwargs: object
                ) -> object:
        check_sync_backend(backend)
        return new(backend, *args, **kwargs)

    _wrap_new(registry, checked)


def _sync_registry() -> type | None:
    """verl's sync-backend factory; None in a verl without one (0.8)."""
    module, name = SYNC_REGISTRY
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def install(engine_cls: type | None = None) -> bool:
    """Wrap ``engine_cls._build_module`` (default verl's ``FSDPEngine``) once and guard
    verl's engine and sync-backend factories (:func:`guard_registry`,
    :func:`guard_sync_registry`); False where verl is not installed. A verl release
    outside :data:`SUPPORTED_VERL` gets a warning."""
    if engine_cls is None:
        engine_cls = _verl_class(ENGINE_CLASS)
        if engine_cls is None:
            return False
        guard_registry(_verl_class(REGISTRY_CLASS))  # type: ignore[arg-type]  # not None: verl is installed
        sync = _sync_registry()
        if sync is not None:
            guard_sync_registry(sync)
    build = engine_cls._build_module  # type: ignore[attr-defined]  # verl's engine method
    if build not in INSTALLED:
        engine_cls._build_module = wrap_build(build)  # type: ignore[attr-defined]  # verl's
    fsdp_build = getattr(engine_cls, "_build_fsdp_module", None)
    if fsdp_build is not None and fsdp_build not in INSTALLED:
        engine_cls._build_fsdp_module = wrap_fsdp_build(  # type: ignore[attr-defined]  # verl's
            fsdp_build)
    return True


def _verl_class(path: str) -> type | None:
    """verl's class at ``path``; None where verl is not installed; a warning where its
    release is outside :data:`SUPPORTED_VERL`, and one line where the class is gone."""
    try:
        version = Version(importlib.metadata.version("verl"))
    except importlib.metadata.PackageNotFoundError:
        return None
    if version not in SUPPORTED_VERL and path == ENGINE_CLASS:
        warnings.warn(f"fp4rl: verl {version} is outside the releases its hook follows "
                      f"({SUPPORTED_VERL}); check that {ENGINE_CLASS}._build_module still "
                      "builds the actor", RuntimeWarning, stacklevel=3)
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as err:
        if err.name and not err.name.startswith("verl"):  # verl's own dependency is missing
            raise ImportError(f"fp4rl: verl {version} needs {err.name!r} to import {module}, "
                              f"which is not installed: pip install {err.name}") from None
        raise ImportError(f"fp4rl: verl {version} has no {path} ({err}); the FP4 "
                          f"actor hook follows verl {SUPPORTED_VERL}") from None
    except (ImportError, AttributeError) as err:  # the actor would silently train in bf16
        raise ImportError(f"fp4rl: verl {version} has no {path} ({err}); the FP4 "
                          f"actor hook follows verl {SUPPORTED_VERL}") from None


class HFOverrides(TypedDict):
    """What vLLM lays over the model's config.json: the method's entry."""

    quantization_config: QuantizationEntry


class EngineKwargs(TypedDict):
    """verl's ``engine_kwargs.vllm`` for an fp4rl rollout: vLLM's ``quantization`` and
    ``hf_overrides`` arguments."""

    quantization: str
    hf_overrides: HFOverrides


def engine_kwargs(recipe: Recipe | str,
                  weight_storage: WeightStorage | str = WeightStorage.DEQUANTIZED
                  ) -> EngineKwargs:
    """``actor_rollout_ref.rollout.engine_kwargs.vllm`` that run ``recipe``'s rollout
    policy in verl's vLLM engine."""
    return EngineKwargs(quantization=QUANT_METHOD, hf_overrides=HFOverrides(
        quantization_config=quantization_config(recipe, weight_storage)))


def hydra_overrides(recipe: Recipe | str,
                    weight_storage: WeightStorage | str = WeightStorage.DEQUANTIZED
                    ) -> list[str]:
    """The ``verl.trainer.main_ppo`` command-line overrides that train verl's actor in FP4
    and roll out in vLLM with ``recipe`` (each one shell argument). ``recipe`` reaches both
    from one value: the engine's ``quantization_config`` and the actor's ``FP4RL_RECIPE``
    (the recipe's JSON, so a name and the :class:`Recipe` it stands for give the same
    overrides, and a recipe built in code needs no name)."""
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    kwargs = engine_kwargs(recipe, weight_storage)
    prefix = "+actor_rollout_ref.rollout.engine_kwargs.vllm"
    return ["actor_rollout_ref.model.external_lib=fp4rl.integrations.verl", FSDP2, FP32_PARAMS,
            f"{prefix}.quantization={kwargs['quantization']}",
            f"{prefix}.hf_overrides={_hydra(kwargs['hf_overrides'])}",
            f"+ray_kwargs.ray_init.runtime_env.env_vars.{RECIPE_ENV}="
            f"{_hydra(encode_recipe(recipe))}"]


def _hydra(value: object) -> str:
    """``value`` in Hydra's override grammar (strings quoted, mappings and lists nested)."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_hydra(v) for v in value) + "]"
    return "null" if value is None else json.dumps(value)  # strings double-quoted


def main(argv: list[str] | None = None) -> int:
    """Print the overrides for ``--recipe``, quoted for a shell, or one line on a bad
    recipe."""
    parser = argparse.ArgumentParser(prog="python -m fp4rl.integrations.verl",
                                     description="verl command-line overrides for an fp4rl "
                                                 "recipe")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--weight-storage", default="dequantized")
    args = parser.parse_args(argv)
    try:
        lines = hydra_overrides(args.recipe, args.weight_storage)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(" \\\n".join(shlex.quote(line) for line in lines))
    return 0


install()

__all__ = ["CASTING_SYNC_BACKENDS", "COMPUTE_DTYPE", "DEFAULT_RECIPE", "ENGINE_CLASS",
           "FP32_PARAMS", "FSDP2", "INSTALLED", "RECIPE_ENV", "SUPPORTED_VERL", "check_param_dtype",
           "check_strategy", "check_sync_backend", "engine_kwargs", "fp4_actor",
           "guard_registry", "guard_sync_registry", "hydra_overrides", "install",
           "is_fp4_actor", "recipe_from_env", "wrap_build", "wrap_fsdp_build"]

if __name__ == "__main__":
    sys.exit(main())
