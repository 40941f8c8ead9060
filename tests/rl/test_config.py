"""The training config: one-line errors that name the field, the shipped presets, and
`key=value` overrides read as users mean them."""

from __future__ import annotations

import pytest

from fp4rl.rl.config import ConfigError, load_config


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"grpo\.batch_size \(6\) must be a multiple"):
        load_config(None, ["grpo.batch_size=6", "grpo.mini_batch_size=4"])
    with pytest.raises(ConfigError, match=r"grpo\.learning_rate"):
        load_config(None, ["grpo.learning_rate=-1"])
    with pytest.raises(ConfigError, match=r"train\.weights: 'fp5' is not a format"):
        load_config(None, ["train.weights=fp5"])
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(None, ["grpo.learning_rate"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_presets_validate():
    for name in ("smoke", "demo", "qwen2.5-3b-gsm8k", "qwen2.5-math-7b-dapo"):
        cfg = load_config(name)
        assert cfg.recipe().rollout.recovery.method == "resq"
    paper = load_config("qwen2.5-math-7b-dapo")
    assert (paper.grpo.epsilon, paper.grpo.epsilon_high, paper.grpo.num_generations,
            paper.grpo.batch_size, paper.grpo.learning_rate) == (0.2, 0.28, 16, 128, 1e-6)


def test_overrides_read_numbers_as_meant_and_suggest_keys(capsys, tmp_path):
    from fp4rl.cli import main

    cfg = load_config(None, ["rollout.recovery.method=smoothquant",
                             "rollout.recovery.alpha=1e-1", "grpo.learning_rate=1e-6"])
    assert cfg.recipe().rollout.recovery.config.alpha == 0.1 and cfg.grpo.learning_rate == 1e-6
    with pytest.raises(ConfigError, match="did you mean learning_rate"):
        load_config(None, ["grpo.learning_rat=1e-5"])
    assert main(["train", "--config", "smoke", "--output", str(tmp_path / "r"),
                 "grpo.learning_rat=1e-5"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "learning_rate" in err


def test_overrides_read_yaml_as_users_mean_it():
    """``no`` is the string accelerate's mixed_precision means, not YAML 1.1's false."""
    cfg = load_config(None, ["mixed_precision=no", "grpo.learning_rate=1e-6",
                             "data.strict=true"])
    assert cfg.mixed_precision == "no" and cfg.grpo.learning_rate == 1e-6 and cfg.data.strict
    for pattern in ("2:4", "3:4", "1:2"):  # YAML 1.1 reads 2:4 as the base-60 integer 124
        cfg = load_config(None, ["rollout.recovery.method=resq",
                                 f"rollout.recovery.sparsity={pattern}"])
        assert str(cfg.recipe().rollout.recovery.config.sparsity) == pattern
    assert load_config(None, ["run.seed=010"]).run.seed == 10  # not octal
