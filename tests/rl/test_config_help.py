"""``fp4rl train --help-config``: every setting of the training config, read from the
schema that validates it, so the printed help cannot drift from the code."""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import BaseModel

from fp4rl.cli import main
from fp4rl.errors import ConfigError
from fp4rl.nn.recipe import operand_formats
from fp4rl.recovery import Recovery, get_recovery, list_recoveries
from fp4rl.rl.config import RolloutConfig, TrainConfig, config_fields, flatten, load_config
from fp4rl.rollout import get_engine, list_engines


def _schema_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every setting's dotted key, walked from the models themselves: sections, the
    recovery methods' registered parameter models, the engines' registered settings."""
    keys = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        optional = [a for a in get_args(annotation) if a is not type(None)]
        if len(optional) == 1 and type(None) in get_args(annotation):  # Model | None
            annotation = optional[0]
        if name == "config" and model is Recovery:  # flat beside the method's name
            for method in list_recoveries():
                keys |= _schema_keys(get_recovery(method).config_cls, prefix)
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= _schema_keys(annotation, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    if model is RolloutConfig:
        for engine in list_engines():  # sections that are not fields: run-time engines'
            if get_engine(engine).settings is not None and engine not in model.model_fields:
                keys |= _schema_keys(get_engine(engine).settings, f"{prefix}{engine}.")
    return keys


def test_every_setting_is_described_with_its_type_and_default():
    fields = {f.key: f for f in config_fields()}
    settings = {k for k, f in fields.items() if f.type != "section"}
    assert settings == _schema_keys(TrainConfig)
    assert set(flatten(TrainConfig().model_dump(mode="json"))) <= settings
    assert all(f.description for f in fields.values()), \
        [k for k, f in fields.items() if not f.description]
    assert fields["grpo.num_generations"].default == "8"
    assert fields["grpo.num_generations"].type == "int"
    assert fields["distributed.strategy"].type == "auto | none | ddp | fsdp"
    assert fields["rollout.vllm.enforce_eager"].type == "auto | bool"
    assert fields["eval.size"].type == "int | None"
    assert fields["train.weights"].type.split(" | ") == operand_formats()
    assert fields["rollout.recovery.method"].type.split(" | ") == list_recoveries()
    assert fields["rollout.engine"].type.split(" | ") == [*list_engines(), "auto"]
    takers = [m for m in list_recoveries() if "sparsity" in get_recovery(m).config_cls.model_fields]
    assert fields["rollout.recovery.sparsity"].methods == tuple(takers) == ("resq", "resqw")


def test_a_default_printed_is_the_default_a_config_gets():
    """Each printed default, given back as an override, leaves the config unchanged (its
    recipe included); the recovery's parameters are printed for the methods that take
    them, and one of each is accepted with its method."""
    default = load_config(None, [])
    rows = [f for f in config_fields() if f.type != "section"]
    overrides = [f"{f.key}={f.default}" for f in rows
                 if not f.key.startswith(("rollout.vllm", "rollout.recovery."))
                 and f.key not in ("train", "rollout", "ignore")]
    overrides.append("rollout.recovery.method=none")
    cfg = load_config(None, overrides)
    assert cfg.recipe() == default.recipe()
    assert cfg.model_dump() == default.model_dump()
    for f in rows:
        if f.key.startswith("rollout.recovery.") and f.key != "rollout.recovery.method":
            assert f.methods, f.key
            load_config(None, [f"rollout.recovery.method={f.methods[0]}",
                               f"{f.key}={f.default}"])


def test_help_config_prints_and_exits_without_an_output(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help-config"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for key in ("grpo.learning_rate = 1e-06  (float)", "rollout.vllm.refit_wire = packed",
                "distributed.timeout_s = 600.0"):
        assert key in out


def test_an_engine_brings_its_own_settings_section():
    """A registered engine's settings model is ``rollout.<name>`` in a config: validated
    there, listed by --help-config, handed to the engine, and not part of the recipe;
    nothing in the config schema names it."""
    from pydantic import BaseModel, ConfigDict

    from fp4rl.rollout import KVCacheEngine, register_engine

    class EchoSettings(BaseModel):
        model_config = ConfigDict(extra="forbid")
        depth: int = 3

    class EchoEngine(KVCacheEngine):
        name = "echo"
        summary = "an engine of a test's own"
        settings = EchoSettings

        @classmethod
        def check_config(cls, settings, recipe, shards, named):
            if settings.depth > 8:
                raise ConfigError("rollout.echo.depth: at most 8")

    register_engine(EchoEngine)
    cfg = load_config(None, ["rollout.engine=echo", "rollout.echo.depth=5"])
    assert cfg.rollout.settings_of("echo") == EchoSettings(depth=5)
    assert cfg.recipe() == load_config(None, []).recipe()
    fields = {f.key: f for f in config_fields()}
    assert fields["rollout.echo.depth"].default == "3"
    assert "echo: an engine of a test's own" in fields["rollout.engine"].description
    for overrides, says in ((["rollout.engine=echo", "rollout.echo.depth=9"], "at most 8"),
                            (["rollout.engine=echo", "rollout.echo.width=1"],
                             r"rollout\.echo: unknown key\(s\) \['width'\]"),
                            (["rollout.echo.depth=5"], "rollout.echo configures the echo "
                                                       "engine, and rollout.engine=hf"),
                            (["rollout.hf.depth=5"], "the hf engine takes no settings")):
        with pytest.raises(ConfigError, match=says):
            load_config(None, overrides)
