"""``fp4rl train --help-config``: every setting of the training config, read from the
schema that validates it, so the printed help cannot drift from the code."""

from __future__ import annotations

import pytest

from fp4rl.cli import main
from fp4rl.rl.config import TrainConfig, config_fields, flatten, load_config


def test_every_setting_is_described_with_its_type_and_default():
    fields = {f.key: f for f in config_fields()}
    settings = set(flatten(TrainConfig().model_dump()))
    settings |= {f"rollout.vllm.{k}" for k in
                 load_config(None, ["rollout.engine=vllm"]).vllm_settings().model_dump()}
    settings |= {"rollout.engine"}
    assert settings <= set(fields), settings - set(fields)
    assert all(f.description for f in fields.values()), \
        [k for k, f in fields.items() if not f.description]
    assert fields["grpo.num_generations"].default == "8"
    assert fields["grpo.num_generations"].type == "int"
    assert fields["distributed.strategy"].type == "auto | none | ddp | fsdp"
    assert fields["rollout.vllm.enforce_eager"].type == "auto | bool"
    assert fields["eval.size"].type == "int | None"


def test_a_default_printed_is_the_default_a_config_gets():
    """Each printed default, given back as an override, leaves the config unchanged."""
    default = TrainConfig().model_dump()
    overrides = [f"{f.key}={f.default}" for f in config_fields()
                 if f.type != "section" and not f.key.startswith("rollout")
                 and f.key not in ("train", "ignore")]
    assert load_config(None, overrides).model_dump() == default


def test_help_config_prints_and_exits_without_an_output(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help-config"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for key in ("grpo.learning_rate = 1e-06  (float)", "rollout.vllm.refit_wire = packed",
                "distributed.timeout_s = 600.0"):
        assert key in out
