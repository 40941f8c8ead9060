"""fp4rl inside verl (:mod:`fp4rl.integrations.verl`), tested where verl is not installed
(it needs GPUs): the actor hook on a tiny model built the way verl's engine builds it, and
the command-line overrides read back by Hydra's own parser, the one verl's ``main_ppo``
uses. The sync sequence verl performs against a vLLM engine is in
``tests/vllm_engine/test_verl_sync.py``."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from fp4rl.errors import UserError
from fp4rl.integrations import verl
from fp4rl.models import tiny_model
from fp4rl.nn import fp4_layers
from fp4rl.nn.linear import Mode
from fp4rl.nn.recipe import get_recipe
from fp4rl.rollout.vllm.config import quantization_config, recipe_from_config
from fp4rl.rollout.vllm.host import decode_recipe, encode_recipe


class StandInEngine:
    """What the hook relies on in verl's ``FSDPEngine``: ``_build_module()`` returns the
    Hugging Face model (FP32 for the actor), ``engine_config.forward_only`` is true for a
    model that only computes log-probs (the reference policy), ``model_config.model_type``
    is ``value_model`` for a critic, ``engine_config.mixed_precision`` sets FSDP's
    parameter dtype (bf16 when unset) and ``engine_config.strategy`` FSDP's version
    (``fsdp``, FSDP1, when unset). ``tests/in_verl/`` runs verl's own engine class."""

    def __init__(self, family: str, forward_only: bool = False,
                 model_type: str = "language_model", param_dtype: str | None = "fp32",
                 strategy: str | None = "fsdp2") -> None:
        self.family = family
        mixed = None if param_dtype is None else {"param_dtype": param_dtype}
        self.engine_config = SimpleNamespace(forward_only=forward_only, mixed_precision=mixed,
                                             strategy=strategy)
        self.model_config = SimpleNamespace(model_type=model_type)

    def _build_module(self) -> torch.nn.Module:
        model, _ = tiny_model(self.family)
        return model.float()


@pytest.fixture
def engine_cls():
    cls = type("Engine", (StandInEngine,), {})
    assert verl.install(cls) and verl.install(cls)  # twice: wrapped once
    assert not hasattr(cls._build_module.__wrapped__, "__wrapped__")
    return cls


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_actor_trains_in_fp4_on_fp32_masters(engine_cls, family, monkeypatch):
    monkeypatch.setenv(verl.RECIPE_ENV, "hif4+resq-2:4")
    plain, _ = tiny_model(family)
    actor = engine_cls(family)._build_module()
    layers = fp4_layers(actor)
    assert layers and all(m.mode is Mode.TRAIN for m in layers.values())
    assert {str(m.recipe.train.weights) for m in layers.values()} == {"hif4"}
    assert all(p.dtype == torch.float32 for p in actor.parameters())
    assert actor.state_dict().keys() == plain.state_dict().keys()  # what verl syncs to vLLM
    ids = torch.randint(0, actor.config.vocab_size, (2, 12))
    actor(ids, labels=ids).loss.backward()
    grads = [m.weight.grad for m in layers.values()]
    assert all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads)


def test_the_reference_model_and_a_critic_are_left_as_verl_builds_them(engine_cls):
    assert not fp4_layers(engine_cls("llama", forward_only=True)._build_module())
    assert not fp4_layers(engine_cls("llama", model_type="value_model")._build_module())
    # neither is cast by FSDP into the actor's GEMMs: their dtype is verl's business
    assert not fp4_layers(engine_cls("llama", forward_only=True, param_dtype="bf16")
                          ._build_module())


@pytest.mark.parametrize("param_dtype", [None, "bf16", "fp16"])
def test_fsdp_casting_the_actors_parameters_is_refused_in_one_line(engine_cls, param_dtype):
    with pytest.raises(UserError) as err:
        engine_cls("llama", param_dtype=param_dtype)._build_module()
    message = str(err.value)
    assert "\n" not in message and verl.FP32_PARAMS in message
    assert f"to {param_dtype or 'bf16'} " in message


@pytest.mark.parametrize("strategy", [None, "fsdp"])
def test_fsdp1_for_the_actor_is_refused_in_one_line(engine_cls, strategy):
    """verl's default strategy (``fsdp``, FSDP1) for the actor stops the worker before the
    model is built; the reference policy is not the hook's business."""
    with pytest.raises(UserError) as err:
        engine_cls("llama", strategy=strategy)._build_module()
    assert "\n" not in str(err.value) and verl.FSDP2 in str(err.value)
    assert not fp4_layers(engine_cls("llama", forward_only=True, strategy=strategy)
                          ._build_module())


def test_the_recipe_comes_from_the_environment(engine_cls, monkeypatch):
    monkeypatch.setenv(verl.RECIPE_ENV, "nvfp4")  # a name, as set by hand
    layers = fp4_layers(engine_cls("llama")._build_module())
    assert {str(m.recipe.train.weights) for m in layers.values()} == {"nvfp4"}


def test_an_actor_without_the_recipe_is_refused_in_one_line(engine_cls, monkeypatch):
    """No default recipe: the engine rolls out its own quantization_config's recipe, and an
    actor trained in another would make two policies without an error."""
    monkeypatch.delenv(verl.RECIPE_ENV, raising=False)
    for build in (verl.recipe_from_env, engine_cls("llama")._build_module):
        with pytest.raises(UserError, match=rf"{verl.RECIPE_ENV} is not set") as err:
            build()
        assert "\n" not in str(err.value) and "python -m fp4rl.integrations.verl" in str(err.value)
    # the reference policy needs no recipe
    assert not fp4_layers(engine_cls("llama", forward_only=True)._build_module())
    # neither does an engine whose host sets none (a checkpoint served on its own)
    assert recipe_from_config(quantization_config("hif4")).rollout == get_recipe("hif4").rollout


def _actor_recipe(overrides: list[str], engine_cls, monkeypatch):
    """The recipe verl's actor trains with and the one its engine rolls out, from
    ``overrides`` as Hydra reads them and Ray hands them to each worker."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    values = {o.key_or_group: o.value()
              for o in OverridesParser.create().parse_overrides(overrides)}
    env = values[f"ray_kwargs.ray_init.runtime_env.env_vars.{verl.RECIPE_ENV}"]
    assert isinstance(env, str)  # Ray takes environment variables as strings
    monkeypatch.setenv(verl.RECIPE_ENV, env)
    actor = {m.recipe for m in fp4_layers(engine_cls("llama")._build_module()).values()}
    config = values["actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides"]
    engine = recipe_from_config(config["quantization_config"])  # checked against the actor's
    assert len(actor) == 1
    return actor.pop(), engine


def test_a_recipe_object_and_its_name_give_the_same_overrides_and_actor(engine_cls,
                                                                       monkeypatch):
    name = "mxfp4+resq-channel:0.5"
    assert verl.hydra_overrides(get_recipe(name)) == verl.hydra_overrides(name)
    actor, engine = _actor_recipe(verl.hydra_overrides(get_recipe(name)), engine_cls,
                                  monkeypatch)
    assert actor == get_recipe(name) and engine.rollout == actor.rollout
    assert str(actor.train.weights) == "mxfp4"  # not the paper's default recipe


def test_an_unregistered_recipe_object_reaches_the_actor_whole(engine_cls, monkeypatch):
    """A recipe built in code has no name: it travels as its JSON, train side and
    ``ignore`` list included, and the engine's check accepts it."""
    recipe = get_recipe("nvfp4:fp4/w4a8+resq-2:4")
    recipe = recipe.replace(train=recipe.train.replace(stochastic_gradients=True),
                            ignore=("kind:attention", "last:1"))
    assert all(recipe != get_recipe(n) for n in ("nvfp4", "nvfp4:fp4/w4a8+resq-2:4"))
    assert decode_recipe(encode_recipe(recipe)) == recipe
    actor, engine = _actor_recipe(verl.hydra_overrides(recipe), engine_cls, monkeypatch)
    assert actor == recipe
    assert engine.rollout == recipe.rollout and engine.ignore == recipe.ignore
    layers = fp4_layers(engine_cls("llama")._build_module())
    assert layers and not any("self_attn" in n for n in layers)  # ignore reached the actor


def test_an_engine_rolling_out_another_recipe_than_the_actors_is_refused(monkeypatch):
    recipe = get_recipe("hif4").replace(ignore=("last:1",))
    monkeypatch.setenv(verl.RECIPE_ENV, encode_recipe(recipe))
    with pytest.raises(UserError, match=r"rolls out .* but the actor's FP4RL_RECIPE") as err:
        recipe_from_config(quantization_config("hif4"))  # the same, but for ignore
    assert "\n" not in str(err.value)
    monkeypatch.setenv(verl.RECIPE_ENV, "{not json")
    with pytest.raises(UserError, match="holds no recipe JSON") as err:
        verl.recipe_from_env()
    assert "\n" not in str(err.value)


def test_an_actor_without_fp32_masters_is_warned_about():
    model, _ = tiny_model("llama")
    with pytest.warns(RuntimeWarning, match="model_dtype at fp32"):
        verl.fp4_actor(model.to(torch.bfloat16), "hif4")


def test_without_verl_nothing_is_patched(monkeypatch):
    def absent(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(verl.importlib.metadata, "version", absent)
    assert verl.install() is False


def test_a_verl_release_outside_the_followed_range_is_warned_about(monkeypatch):
    fake = SimpleNamespace(FSDPEngine=type("FSDPEngine", (StandInEngine,), {}),
                           EngineRegistry=type("EngineRegistry", (), {"new": _new_engine}))
    monkeypatch.setattr(verl.importlib.metadata, "version", lambda name: "0.7.1")
    monkeypatch.setattr(verl.importlib, "import_module", lambda name: fake)
    with pytest.warns(RuntimeWarning, match="outside the releases"):
        assert verl.install() is True
    assert fake.FSDPEngine._build_module in verl.INSTALLED


def _new_engine(model_type: str, backend: str, engine: type, **kwargs) -> StandInEngine:
    """verl's ``EngineRegistry.new``, reduced to building the engine class it picked."""
    return engine("llama", model_type=model_type, **kwargs)


def test_an_actor_built_by_an_engine_without_the_hook_stops_the_run(engine_cls):
    registry = type("EngineRegistry", (), {"new": staticmethod(_new_engine)})
    verl.guard_registry(registry)
    verl.guard_registry(registry)  # guarded once
    megatron = type("MegatronEngine", (StandInEngine,), {})
    with pytest.raises(UserError, match=r"MegatronEngine \(backend 'megatron'\).*strategy=fsdp2"):
        registry.new("language_model", "megatron", megatron)
    assert registry.new("language_model", "megatron", megatron, forward_only=True)  # reference
    assert registry.new("value_model", "megatron", megatron)  # a critic
    assert registry.new("language_model", "fsdp", engine_cls)  # the hooked engine


@pytest.mark.parametrize("backend", verl.CASTING_SYNC_BACKENDS)
def test_a_weight_sync_that_casts_the_masters_is_refused_in_one_line(backend, monkeypatch):
    """verl's delta_sharded, kimi and mooncake syncs cast the FP32 masters to the rollout
    dtype: with an FP4 recipe set, verl's sync factory refuses them naming what works;
    the backends that send the weights as they are pass, as does any without a recipe."""
    built = []
    registry = type("CheckpointEngineRegistry", (),
                    {"new": staticmethod(lambda backend, **kw: built.append(backend))})
    verl.guard_sync_registry(registry)
    verl.guard_sync_registry(registry)  # guarded once
    monkeypatch.delenv(verl.RECIPE_ENV, raising=False)
    registry.new(backend, bucket_size=1)
    monkeypatch.setenv(verl.RECIPE_ENV, "hif4+resq-2:4")
    with pytest.raises(UserError, match=rf"'{backend}' casts .*checkpoint_engine.backend=naive"):
        registry.new(backend, bucket_size=1)
    for ok in ("naive", "nccl", "nixl"):
        registry.new(ok, bucket_size=1)
    assert built == [backend, "naive", "nccl", "nixl"]


@pytest.mark.parametrize("recipe", ["hif4+resq-2:4", "nvfp4", "mxfp4+resq-channel:0.5"])
def test_the_overrides_parse_in_hydra_to_the_engine_arguments(recipe):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides(verl.hydra_overrides(recipe))
    values = {o.key_or_group: o.value() for o in overrides}
    prefix = "actor_rollout_ref.rollout.engine_kwargs.vllm"
    kwargs = verl.engine_kwargs(recipe)
    assert values["actor_rollout_ref.model.external_lib"] == "fp4rl.integrations.verl"
    assert values["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"] == "fp32"
    assert values[f"{prefix}.quantization"] == kwargs["quantization"] == "fp4rl"
    assert values[f"{prefix}.hf_overrides"] == kwargs["hf_overrides"]
    assert recipe_from_config(values[f"{prefix}.hf_overrides"]["quantization_config"]) \
        .rollout == get_recipe(recipe).rollout
    env = values[f"ray_kwargs.ray_init.runtime_env.env_vars.{verl.RECIPE_ENV}"]
    assert decode_recipe(env) == get_recipe(recipe)


def test_the_overrides_command_says_one_line_on_a_bad_recipe(capsys):
    assert verl.main(["--recipe", "hif4+smoothquant"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot run inside vLLM" in err[0]
    assert verl.main(["--recipe", "hif4"]) == 0
    assert "external_lib=fp4rl.integrations.verl" in capsys.readouterr().out


def test_a_verl_without_the_engine_class_stops_with_one_line(monkeypatch):
    def missing(name: str):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(verl.importlib.metadata, "version", lambda name: "0.9.1")
    monkeypatch.setattr(verl.importlib, "import_module", missing)
    with pytest.raises(ImportError, match=r"verl 0\.9\.1 has no .*FSDPEngine"):
        verl.install()


def test_a_missing_dependency_of_verl_is_named_with_its_install():
    """verl imports its engine's dependencies (peft, say) at module level: the one line
    names what is missing, not a verl without the engine class."""
    def missing(name: str):
        raise ModuleNotFoundError("No module named 'peft'", name="peft")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verl.importlib.metadata, "version", lambda name: "0.9.1")
        patch.setattr(verl.importlib, "import_module", missing)
        with pytest.raises(ImportError, match=r"needs 'peft'.*pip install peft") as err:
            verl.install()
    assert "\n" not in str(err.value)
