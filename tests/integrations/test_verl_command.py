"""The documented verl command (docs/integrations.md, "verl") runs fp4rl's
``qwen2.5-3b-gsm8k`` preset: every preset setting verl also has is set in the command to
the preset's value, key by key, and every preset setting verl has no counterpart for is
named here with the reason. Reads only the preset and the page (no verl needed);
``tests/in_verl/test_verl_config.py`` composes the same command with verl's own config."""

from __future__ import annotations

import shlex
from collections.abc import Callable

import yaml
from _paths import ROOT

from fp4rl.presets import preset_path
from fp4rl.rl.config import validate

DOCS = ROOT / "docs" / "integrations.md"
MAIN = "python3 -m verl.trainer.main_ppo"
PRESET = "qwen2.5-3b-gsm8k"


def same(value: object) -> object:
    return value


#: fp4rl setting -> (verl's key, fp4rl's value as verl writes it)
IN_VERL: dict[str, tuple[str, Callable[[object], object]]] = {
    "grpo.epsilon": ("actor_rollout_ref.actor.clip_ratio_low", same),
    "grpo.epsilon_high": ("actor_rollout_ref.actor.clip_ratio_high", same),
    "grpo.tis_imp_ratio_cap": ("algorithm.rollout_correction.rollout_is_threshold", same),
    "grpo.beta": ("actor_rollout_ref.actor.use_kl_loss", lambda b: b > 0),
    "grpo.loss_agg_mode": ("actor_rollout_ref.actor.loss_agg_mode", same),
    "grpo.num_generations": ("actor_rollout_ref.rollout.n", same),
    "grpo.batch_size": ("data.train_batch_size", same),
    "grpo.micro_batch_size": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", same),
    "grpo.ppo_epochs": ("actor_rollout_ref.actor.ppo_epochs", same),
    "grpo.learning_rate": ("actor_rollout_ref.actor.optim.lr", same),
    "grpo.weight_decay": ("actor_rollout_ref.actor.optim.weight_decay", same),
    "grpo.max_grad_norm": ("actor_rollout_ref.actor.optim.clip_grad", same),
    "grpo.temperature": ("actor_rollout_ref.rollout.temperature", same),
    "grpo.top_p": ("actor_rollout_ref.rollout.top_p", same),
    "grpo.top_k": ("actor_rollout_ref.rollout.top_k", lambda k: k or -1),  # off: 0 / -1
    "grpo.max_prompt_length": ("data.max_prompt_length", same),
    "grpo.max_response_length": ("data.max_response_length", same),
    "run.steps": ("trainer.total_training_steps", same),
    "run.save_steps": ("trainer.save_freq", same),
    "run.keep_checkpoints": ("trainer.max_actor_ckpt_to_keep", same),
}
#: fp4rl's mini-batch (None: the whole step's prompts) is verl's ppo_mini_batch_size
MINI_BATCH = "actor_rollout_ref.actor.ppo_mini_batch_size"
#: what fp4rl always does and verl makes a choice of
ALWAYS = {"algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": True,
          "algorithm.rollout_correction.rollout_is": "token"}
#: preset settings with no verl counterpart in this command, and why
NOT_IN_VERL = {
    "grpo.mini_batch_size": f"checked against {MINI_BATCH} below (None: one update a step)",
    "grpo.mismatch_tokens": "which tokens fp4rl's mismatch metrics average over; verl's "
                            "rollout_corr/* metrics are its own",
    "run.seed": "verl seeds its data loader and engines itself",
    "optimizer.name": "AdamW, verl's default optimizer",
    "optimizer.kwargs": "none set: torch's AdamW defaults, as verl's betas (0.9, 0.999)",
    "eval.size": "verl validates on the whole test file",
    "eval.mean_at_k": "verl's val_kwargs.n (1) and greedy decoding by default",
    "eval.temperature": "verl's validation decodes greedily (val_kwargs.do_sample false)",
    "eval.max_new_tokens": "verl validates with data.max_response_length (1024, the same)",
    "eval.prompt_seed": "verl validates on the whole test file",
}
SECTIONS = ("grpo", "run", "optimizer", "eval")


def documented() -> dict[str, object]:
    """The documented ``main_ppo`` overrides, as Hydra reads their values."""
    section = DOCS.read_text().split("\n## verl\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    command = block[block.index(MAIN) + len(MAIN):]
    out: dict[str, object] = {}
    for word in shlex.split(command.replace("\\\n", " ")):
        key, _, text = word.partition("=")
        out[key.lstrip("+")] = yaml.safe_load(text) if not _number(text) else float(text)
    return out


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return not text.isdigit()


def preset() -> dict[str, object]:
    cfg = validate(yaml.safe_load(preset_path(PRESET).read_text())).model_dump(mode="json")
    return {f"{s}.{k}": v for s in SECTIONS for k, v in cfg[s].items()}


def test_every_preset_setting_is_in_the_command_or_named_as_not_verls():
    settings = preset()
    assert set(settings) == set(IN_VERL) | set(NOT_IN_VERL), (
        "a preset setting is neither mapped to verl nor listed as verl's own",
        sorted(set(settings) ^ (set(IN_VERL) | set(NOT_IN_VERL))))


def test_the_command_sets_each_to_the_preset_s_value():
    settings, command = preset(), documented()
    wrong = {}
    for key, (verl_key, convert) in IN_VERL.items():
        expected = convert(settings[key])
        if command.get(verl_key, "<not set>") != expected:
            wrong[key] = (verl_key, command.get(verl_key, "<not set>"), expected)
    assert not wrong, wrong
    mini = settings["grpo.mini_batch_size"] or settings["grpo.batch_size"]
    assert command[MINI_BATCH] == mini
    assert {k: command.get(k) for k in ALWAYS} == ALWAYS


def test_the_run_reads_the_files_fp4rl_writes():
    command = documented()
    section = DOCS.read_text().split("\n## verl\n", 1)[1]
    assert "python3 -m fp4rl.integrations.verl_data --output ~/data/gsm8k" in section
    assert command["data.train_files"] == "$HOME/data/gsm8k/train.parquet"
    assert command["data.val_files"] == "$HOME/data/gsm8k/test.parquet"


def test_the_command_carries_the_overrides_fp4rl_prints():
    """Word for word what ``python -m fp4rl.integrations.verl`` prints for the paper's
    recipe, the actor's ``FP4RL_RECIPE`` included: the engine and the actor get one recipe."""
    from fp4rl.integrations import verl

    section = DOCS.read_text().split("\n## verl\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    words = shlex.split(block[block.index(MAIN) + len(MAIN):].replace("\\\n", " "))
    missing = set(verl.hydra_overrides(verl.DEFAULT_RECIPE)) - set(words)
    assert not missing, missing
