"""GRPO with FP4 rollout and training policies: rollout engine, rewards, loss, trainer."""

from fp4rl.rl.config import ConfigError, TrainConfig, load_config
from fp4rl.rl.evaluate import EvalResult, evaluate
from fp4rl.rl.grpo import LossConfig, group_advantages, grpo_loss
from fp4rl.rl.rewards import get_reward, list_rewards, register_reward
from fp4rl.rl.rundir import RunDir, read_metrics
from fp4rl.rl.trainer import Trainer
from fp4rl.rollout import RolloutBatch, SamplingConfig, generate, position_ids

__all__ = [
           "ConfigError",
           "EvalResult",
           "LossConfig",
           "RolloutBatch",
           "RunDir",
           "SamplingConfig",
           "TrainConfig",
           "Trainer",
           "evaluate",
           "generate",
           "get_reward",
           "group_advantages",
           "grpo_loss",
           "list_rewards",
           "load_config",
           "position_ids",
           "read_metrics",
           "register_reward",
]
