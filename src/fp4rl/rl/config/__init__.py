"""Training configuration: a YAML file plus ``key=value`` overrides, validated with pydantic.

Top-level ``model``, ``train``, ``rollout`` and ``ignore`` are the policy and its recipe
(``rollout`` also names the engine and holds that engine's own settings: docs/architecture.md,
"Names"); the other sections configure data, GRPO, evaluation and the run. Every field
carries its description, which ``fp4rl train --help-config`` prints. GRPO option names
follow TRL's GRPOConfig (``num_generations``, ``epsilon``, ``epsilon_high``, ``beta``,
``learning_rate``) and verl where TRL has no equivalent (``loss_agg_mode``,
``tis_imp_ratio_cap``); see ``docs/training.md``.

One module per concern: :mod:`.schema` (the sections and :class:`TrainConfig`),
:mod:`.loading` (files, presets, validation into one-line problems), :mod:`.overrides`
(``key=value``), :mod:`.yaml12` (YAML as a config's author means it), :mod:`.help`
(``--help-config``) and :mod:`.changes` (what a resumed run may change).
"""

from fp4rl.errors import ConfigError
from fp4rl.rl.config.changes import RESUMABLE, changed_settings, describe_changes, flatten
from fp4rl.rl.config.help import ConfigField, config_fields
from fp4rl.rl.config.loading import load_config, validate
from fp4rl.rl.config.overrides import apply_override, set_path
from fp4rl.rl.config.schema import (
    DataConfig,
    DistributedConfig,
    EvalConfig,
    GRPOConfig,
    OptimizerConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    recipe_of,
)
from fp4rl.rl.grpo import LOSS_AGG_MODES

__all__ = ["LOSS_AGG_MODES", "RESUMABLE", "ConfigError", "ConfigField", "DataConfig",
           "DistributedConfig", "EvalConfig", "GRPOConfig", "OptimizerConfig", "RolloutConfig",
           "RunConfig", "TrainConfig", "apply_override", "changed_settings", "config_fields",
           "describe_changes", "flatten", "load_config", "recipe_of", "set_path", "validate"]
