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
            method = f.description.rsplit("(", 1)[1].split(",")[0].rstrip(")")
            load_config(None, [f"rollout.recovery.method={method}", f"{f.key}={f.default}"])


def test_help_config_prints_and_exits_without_an_output(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help-config"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for key in ("grpo.learning_rate = 1e-06  (float)", "rollout.vllm.refit_wire = packed",
                "distributed.timeout_s = 600.0"):
        assert key in out
