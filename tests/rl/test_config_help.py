"""``fp4rl train --help-config``: every setting of the training config, read from the
schema that validates it, so the printed help cannot drift from the code."""

from __future__ import annotations

import pytest

from fp4rl.cli import main
from fp4rl.errors import ConfigError
from fp4rl.rl.config import TrainConfig, config_fields, flatten, load_config


def test_every_setting_is_described_with_its_type_and_default():
    fields = {f.key: f for f in config_fields()}
    settings = set(flatten(TrainConfig().model_dump()))
    settings |= {f"rollout.vllm.{k}" for k in
                 load_config(None, ["rollout.engine=vllm"]).engine_options("vllm")}
    settings |= {"rollout.engine"}
    assert settings <= set(fields), settings - set(fields)
    assert all(f.description for f in fields.values()), \
        [k for k, f in fields.items() if not f.description]
    assert fields["grpo.num_generations"].default == "8"
    assert fields["grpo.num_generations"].type == "int"
    assert fields["distributed.strategy"].type == "auto | none | ddp | fsdp"
    assert fields["rollout.vllm.enforce_eager"].type == "auto | bool"
    assert fields["eval.size"].type == "int | None"
    assert "hif4" in fields["train.weights"].type.split(" | ")
    assert "resq" in fields["rollout.recovery.method"].type.split(" | ")
    assert fields["rollout.recovery.sparsity"].description.endswith("(resq, resqw)")


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
    assert cfg.model_dump(exclude={"train", "rollout"}) == \
        default.model_dump(exclude={"train", "rollout"})
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
    assert cfg.engine_options("echo") == {"depth": 5}
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
