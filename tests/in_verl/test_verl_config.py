"""The verl command line of docs/integrations.md, composed with verl's own Hydra config and
checked by verl's own ``validate_config``, as ``verl.trainer.main_ppo`` does before any
worker starts. The command is read from the docs, so the docs cannot drift from what verl
accepts."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

verl_trainer = pytest.importorskip("verl.trainer", reason="verl is not installed; "
                                   "`make test-verl` runs these tests in an environment of "
                                   "its own")

from fp4rl.errors import UserError  # noqa: E402
from fp4rl.integrations import verl  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
MAIN = "python3 -m verl.trainer.main_ppo"


def documented_overrides() -> list[str]:
    """The overrides of the documented ``main_ppo`` command, as a shell splits them."""
    section = DOCS.read_text().split("\n## verl\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    command = block[block.index(MAIN) + len(MAIN):]
    return shlex.split(command.replace("\\\n", " "))


def compose(overrides: list[str]):
    """verl's PPO trainer config with ``overrides``, as its Hydra main composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = Path(verl_trainer.__file__).parent / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


def validate(config) -> None:
    """What ``verl.trainer.main_ppo.main`` checks before it starts Ray."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config, need_reference_policy(config), need_critic(config))


def test_the_documented_command_passes_verls_own_validation():
    overrides = documented_overrides()
    assert set(verl.hydra_overrides(verl.DEFAULT_RECIPE)) <= set(overrides)  # the docs' own
    config = compose(overrides)
    validate(config)
    rollout = config.actor_rollout_ref.rollout
    kwargs = verl.engine_kwargs(verl.DEFAULT_RECIPE)
    assert rollout.engine_kwargs.vllm.quantization == kwargs["quantization"]
    assert dict(rollout.engine_kwargs.vllm.hf_overrides.quantization_config) == \
        kwargs["hf_overrides"]["quantization_config"]
    assert config.actor_rollout_ref.model.external_lib == "fp4rl.integrations.verl"
    verl.check_param_dtype(config.actor_rollout_ref.actor.fsdp_config)  # FP32 parameters


def test_verl_refuses_the_command_without_its_log_prob_batch():
    """The test can fail: verl's own check refuses what the docs once said."""
    overrides = [o for o in documented_overrides() if "log_prob_micro_batch" not in o]
    with pytest.raises(ValueError, match="log_prob_micro_batch_size"):
        validate(compose(overrides))


def test_verls_default_fsdp_precision_is_refused_by_the_hook():
    overrides = [o for o in documented_overrides() if not o.startswith(verl.FP32_PARAMS)]
    with pytest.raises(Exception, match="param_dtype=fp32"):
        verl.check_param_dtype(compose(overrides).actor_rollout_ref.actor.fsdp_config)


def test_verls_default_fsdp1_is_refused_by_the_hook_in_one_line():
    """The documented command sets FSDP2; without it verl's default (FSDP1) is refused."""
    config = compose(documented_overrides())
    assert config.actor_rollout_ref.actor.strategy == "fsdp2"
    assert config.actor_rollout_ref.ref.strategy == "fsdp2"
    verl.check_strategy(config.actor_rollout_ref.actor)
    overrides = [o for o in documented_overrides() if o != verl.FSDP2]
    with pytest.raises(Exception, match="strategy=fsdp2") as refused:
        verl.check_strategy(compose(overrides).actor_rollout_ref.actor)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("backend", verl.CASTING_SYNC_BACKENDS)
def test_verls_own_sync_factory_refuses_a_backend_that_casts(backend, monkeypatch):
    """The documented command leaves verl's sync backend at ``naive``, which sends the FP32
    masters as they are; after the hook is installed (the actor worker imports it as
    ``external_lib``), verl's own factory refuses the backends that cast them."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    config = compose(documented_overrides())
    naive = config.actor_rollout_ref.rollout.checkpoint_engine.backend
    assert naive == "naive" and naive not in verl.CASTING_SYNC_BACKENDS
    assert verl.install()
    monkeypatch.setenv(verl.RECIPE_ENV, verl.DEFAULT_RECIPE)
    with pytest.raises(UserError, match=f"'{backend}' casts") as refused:
        CheckpointEngineRegistry.new(backend, is_master=True, bucket_size=1 << 20)
    assert "\n" not in str(refused.value)
    assert CheckpointEngineRegistry.new(naive, is_master=True, bucket_size=1 << 20)
