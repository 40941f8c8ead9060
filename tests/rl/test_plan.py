"""The run plan: a training config resolved once, at the edge, into the objects the trainer
and its engine take (process group and device, compute dtype, recipe, engine class with
its typed settings), each engine refusal made once."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from fp4rl.errors import ConfigError, UserError
from fp4rl.models import tiny_model
from fp4rl.rl import plan as plan_module
from fp4rl.rl.config import load_config
from fp4rl.rl.plan import RunPlan, plan_run
from fp4rl.rl.trainer import Trainer
from fp4rl.rollout import KVCacheEngine, RolloutSetup, register_engine

SMALL = ["grpo.num_generations=2", "grpo.batch_size=2", "grpo.micro_batch_size=2",
         "grpo.max_response_length=4", "data.train_size=4", "device=cpu"]


@pytest.mark.parametrize(("precision", "dtype"), [("no", torch.float32),
                                                  ("bf16", torch.bfloat16)])
def test_the_plan_holds_objects_resolved_from_the_names(precision, dtype):
    cfg = load_config(None, [*SMALL, f"mixed_precision={precision}", "recipe=hif4"])
    plan = plan_run(cfg)
    assert plan.device == torch.device("cpu") and plan.compute_dtype is dtype
    assert plan.mixed_precision == precision and plan.dist.world_size == 1
    assert plan.recipe == cfg.recipe()
    assert plan.engine is KVCacheEngine and plan.engine_settings is None
    # the config as run says what was resolved, so its config.yaml reproduces the run
    assert plan.config.device == "cpu" and plan.config.distributed.strategy == "none"
    auto = plan_run(load_config(None, [*SMALL, "mixed_precision=auto"]))
    assert auto.config.mixed_precision in ("no", "bf16") and \
        auto.compute_dtype is (torch.bfloat16 if auto.mixed_precision == "bf16"
                               else torch.float32)


def test_a_batch_the_processes_cannot_share_is_refused_by_the_plan(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = load_config(None, [*SMALL, "grpo.batch_size=2"])
    assert isinstance(plan_run(cfg), RunPlan)
    fake = plan_module.Dist(world_size=3, strategy="ddp")
    monkeypatch.setattr(plan_module, "setup", lambda *a: (fake, torch.device("cpu")))
    with pytest.raises(ConfigError, match=r"grpo.batch_size \(2\) does not divide by the 3"):
        plan_run(cfg)


class _Depth(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    depth: int = 3


class _Counting(KVCacheEngine):
    """fp4rl's engine, counting the plan's calls into it."""

    name = "counting"
    summary = "a test's engine"
    settings = _Depth
    checks: ClassVar[list[int]] = []
    setups: ClassVar[list[RolloutSetup]] = []

    @classmethod
    def check(cls, recipe, device, world_size):
        cls.checks.append(world_size)

    @classmethod
    def from_setup(cls, setup):
        cls.setups.append(setup)
        return super().from_setup(setup)


def test_a_trainer_checks_its_engine_and_joins_the_process_group_once(tmp_path, monkeypatch):
    """The engine's check and the distributed set-up run when the plan is made, once,
    and the engine reads its own section typed, with the run's compute dtype."""
    register_engine(_Counting)
    _Counting.checks.clear()
    _Counting.setups.clear()
    joined = []
    real_setup = plan_module.setup
    monkeypatch.setattr(plan_module, "setup", lambda *a: joined.append(a) or real_setup(*a))
    cfg = load_config(None, [*SMALL, "rollout.engine=counting", "rollout.counting.depth=5",
                             "mixed_precision=no"])
    model, tok = tiny_model("llama")
    trainer = Trainer(cfg, tmp_path, model, tok, log=lambda m: None)
    assert len(joined) == 1 and _Counting.checks == [1]
    [setup] = _Counting.setups
    assert setup.settings_as(_Depth) == _Depth(depth=5)
    assert setup.compute_dtype is torch.float32 and setup.recipe is trainer.recipe
    # a plan made already is taken as it is: nothing resolved or checked again
    again = Trainer(trainer.plan, tmp_path / "again", *tiny_model("llama"), log=lambda m: None)
    assert len(joined) == 1 and _Counting.checks == [1] and again.plan is trainer.plan


def test_the_plan_holds_batch_invariance_and_its_engine(monkeypatch):
    """``batch_invariant`` is the plan's (the trainer reads it there, not from the raw
    config), its engine fp4rl's own whatever ``auto`` would pick, and the rule that it needs
    that engine is one function the config, the plan and the TRL trainer call."""
    from fp4rl.rollout import check_invariant_engine, resolve_engine

    monkeypatch.setattr(plan_module, "check_batch_invariant", lambda device: None)
    plan = plan_run(load_config(None, [*SMALL, "batch_invariant=true", "rollout.engine=auto"]))
    assert plan.batch_invariant and plan.engine is KVCacheEngine
    assert not plan_run(load_config(None, SMALL)).batch_invariant
    cuda = torch.device("cuda")  # where auto would pick vLLM, were it installed
    assert resolve_engine("auto", cuda, plan.recipe, batch_invariant=True) == "hf"
    check_invariant_engine("hf")
    check_invariant_engine("auto")
    for where in (lambda: check_invariant_engine("vllm"),
                  lambda: resolve_engine("vllm", cuda, plan.recipe, batch_invariant=True),
                  lambda: load_config(None, [*SMALL, "batch_invariant=true",
                                             "rollout.engine=vllm"])):
        with pytest.raises(UserError, match=r"runs a batch-invariant engine \(set "
                           r"rollout.engine to hf\), not vllm") as err:
            where()
        assert "\n" not in str(err.value)


def test_engines_are_chosen_by_what_they_say_of_themselves():
    """Batch invariance, ``auto``'s pick and its help ask each engine's capabilities, not
    its name: an engine registered at run time that says it is batch-invariant serves a
    batch-invariant run, and one of higher ``auto_priority`` that serves the run is what
    ``auto`` picks (first in the help too); one that does not serve it is passed over."""
    from fp4rl.rollout import check_invariant_engine, resolve_engine
    from fp4rl.rollout.registry import _ENGINES as engines
    from fp4rl.rollout.registry import auto_picks

    class Eager(KVCacheEngine):
        name = "eager-test"
        summary = "a test's engine"
        auto_priority = 100
        auto_when = "where the test says"
        serving: ClassVar[bool] = True

        @classmethod
        def serves(cls, recipe, device):
            return cls.serving

    class Loose(Eager):
        name = "loose-test"
        batch_invariant = False
        auto_priority = 200

    register_engine(Eager)
    register_engine(Loose)
    try:
        recipe = load_config(None, SMALL).recipe()
        cpu = torch.device("cpu")
        check_invariant_engine("eager-test")  # says it is: no name list to edit
        with pytest.raises(UserError, match="not loose-test"):
            check_invariant_engine("loose-test")
        assert resolve_engine("auto", cpu, recipe) == "loose-test"
        assert resolve_engine("auto", cpu, recipe, batch_invariant=True) == "eager-test"
        Eager.serving = False  # Loose inherits it: neither serves now
        assert resolve_engine("auto", cpu, recipe) == "hf"
        assert auto_picks().startswith("loose-test where the test says, else eager-test")
        assert auto_picks().endswith("else hf")
    finally:
        engines.unregister("eager-test")
        engines.unregister("loose-test")


def test_an_engine_that_does_not_say_its_capabilities_is_refused():
    from fp4rl.rollout import EngineError

    class Bare:
        name = "bare-test"

    with pytest.raises(EngineError, match="does not say summary, settings, batch_invariant"):
        register_engine(Bare)  # type: ignore[arg-type]


def test_the_plan_holds_the_weight_cache_setting():
    """The plan says whether the FP4 layers keep Q(W) (and turns it off where the run
    shards its weights)."""
    assert plan_run(load_config(None, SMALL)).weight_cache
    assert not plan_run(load_config(None, [*SMALL, "weight_cache=false"])).weight_cache
