"""The training config's schema: one pydantic model per section, :class:`TrainConfig` the
whole. Every field carries its description, which ``fp4rl train --help-config`` prints
(:mod:`.help`). The recipe's parts (``train``, ``rollout``, ``ignore``) are validated by
:class:`~fp4rl.nn.recipe.Recipe`; each rollout engine's own section, ``rollout.<engine>``,
by the settings model the engine registered."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fp4rl.data.synthetic import SYNTHETIC_TASKS
from fp4rl.errors import RecipeError, UserError
from fp4rl.nn.recipe import Recipe
from fp4rl.rl.grpo import LossConfig
from fp4rl.rollout.registry import (
    AUTO,
    DEFAULT_ENGINE,
    EngineError,
    engine_name,
    get_engine,
    list_engines,
)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    source: str = Field("synthetic", description="synthetic (arithmetic), synthetic-words "
                        "(word problems), or a file layout: gsm8k, math500, aime24, ... dapo")
    train_path: str | None = Field(None, description="the training examples' file (local, "
                                   "or hf://datasets/ORG/NAME/FILE) for a file layout")
    test_path: str | None = Field(None, description="the test examples' file, as train_path")
    levels: list[int] = Field(default_factory=lambda: [1, 2],
                              description="the synthetic tasks' difficulty levels")
    train_size: int = Field(2000, ge=1, description="training examples (generated, or the "
                            "file's first ones)")
    test_size: int = Field(200, ge=1, description="test examples, as train_size")
    template: str | None = Field(None, description="the prompt template's name; default: "
                                 "the layout's")
    fields: dict[str, str] | None = Field(None, description="which of a file's fields hold "
                                          "the question and the answer (AIME/AMC-style "
                                          "releases)")
    strict: bool = Field(False, description="refuse a malformed row, instead of skipping it")
    reward: str | None = Field(None, description="the reward's name (fp4rl.rl.rewards); "
                               "default: the layout's")

    @model_validator(mode="after")
    def _read_as_configured(self) -> DataConfig:
        """Refuse what the source would silently ignore: a file for a generated source,
        or a level the generator does not have."""
        if self.source not in SYNTHETIC_TASKS:
            return self
        paths = [f"data.{k}" for k in ("train_path", "test_path") if getattr(self, k)]
        if paths:
            raise ValueError(f"data.source={self.source} generates its examples and reads no "
                             f"file: drop {' and '.join(paths)}, or set data.source to the "
                             f"file's layout (e.g. gsm8k)")
        known = sorted(SYNTHETIC_TASKS[self.source])
        if not self.levels or set(self.levels) - set(known):
            raise ValueError(f"data.levels={self.levels}: choose among {known} for "
                             f"data.source={self.source}")
        return self


class GRPOConfig(LossConfig):
    """GRPO's sampling, batching and optimizer settings; the loss fields are
    :class:`fp4rl.rl.grpo.LossConfig`'s (epsilon, epsilon_high, tis_imp_ratio_cap, beta,
    loss_agg_mode)."""

    num_generations: int = Field(8, ge=2, description="G, the responses sampled per "
                                 "prompt (the group its advantages normalize over)")
    batch_size: int = Field(8, ge=1, description="prompts per RL step")
    mini_batch_size: int | None = Field(None, ge=1, description="prompts per optimizer "
                                        "step; default: batch_size (one step per epoch)")
    micro_batch_size: int = Field(16, ge=1, description="sequences per forward and "
                                  "backward (gradient accumulation beyond it)")
    ppo_epochs: int = Field(1, ge=1, description="passes over each step's rollouts")
    learning_rate: float = Field(1e-6, gt=0, description="the optimizer's learning rate")
    weight_decay: float = Field(0.0, ge=0, description="the optimizer's weight decay")
    max_grad_norm: float = Field(1.0, ge=0, description="gradient clipping by global norm; "
                                 "0: none")
    temperature: float = Field(1.0, gt=0, description="the rollout's sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="the rollout's nucleus sampling")
    top_k: int = Field(0, ge=0, description="the rollout's top-k sampling; 0: off")
    max_prompt_length: int = Field(512, ge=1, description="longest prompt, in tokens "
                                   "(longer ones are refused)")
    max_response_length: int = Field(256, ge=1, description="most tokens a response takes")

    @model_validator(mode="after")
    def _batches_divide(self) -> GRPOConfig:
        mini = self.mini_batch_size or self.batch_size
        if self.batch_size % mini:
            raise ValueError(f"grpo.batch_size ({self.batch_size}) must be a multiple of "
                             f"grpo.mini_batch_size ({mini})")
        return self


class OptimizerConfig(_Section):
    """The optimizer, by the name of its ``torch.optim`` class (case-insensitive), with
    keyword arguments beyond ``lr`` and ``weight_decay`` (``grpo.learning_rate``,
    ``grpo.weight_decay``), e.g. ``{name: AdamW, kwargs: {betas: [0.9, 0.95]}}``."""

    name: str = Field("AdamW", description="a torch.optim class, by name "
                      "(case-insensitive)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="its keyword arguments "
                                   "beyond lr and weight_decay")


class DistributedConfig(_Section):
    """Several processes (launched by torchrun or accelerate) on torch.distributed."""

    strategy: Literal["auto", "none", "ddp", "fsdp"] = Field(
        "auto", description="how the processes share the model: ddp (replicas), fsdp "
        "(FSDP2 shards); auto: ddp when launched on several processes, none on one")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed's backend; auto: nccl on CUDA, gloo on CPU")
    timeout_s: float = Field(600.0, gt=0, description="seconds a collective waits before "
                             "failing (a dead rank ends the run, not hangs it)")

    @property
    def shards(self) -> bool:
        """Whether the run shards its model (FSDP2), as ``Dist.shards`` says once launched."""
        return self.strategy == "fsdp"


class EvalConfig(_Section):
    steps: int = Field(0, ge=0, description="evaluate every N steps during training; 0: "
                       "off")
    size: int | None = Field(None, ge=1, description="test prompts; default: "
                             "data.test_size")
    mean_at_k: int = Field(1, ge=1, description="1: greedy Mean@1; k > 1: Mean@k, k "
                           "sampled responses per prompt")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of Mean@k")
    max_new_tokens: int | None = Field(None, ge=1, description="default: "
                                       "grpo.max_response_length")
    prompt_seed: int | None = Field(None, ge=0, description="seed that draws the synthetic "
                                    "test prompts (default: run.seed); fixing it scores every "
                                    "seed of a multi-seed grid on the same prompts, paired")


class RunConfig(_Section):
    steps: int = Field(40, ge=1, description="RL steps of the run")
    seed: int = Field(0, description="seeds the data order, the rollouts' sampling and "
                      "any random initialization")
    save_steps: int = Field(10, ge=1, description="a checkpoint every N steps (and at the "
                            "last)")
    keep_checkpoints: int = Field(2, ge=1, description="the newest checkpoints kept")


class TrainConfig(_Section):
    model: str = Field("smollm2-135m", description="the policy: an embedded model's name, "
                       "a local Hugging Face directory, or a Hub id ORG/NAME")
    mixed_precision: Literal["no", "bf16", "auto"] = Field(
        "auto", description="the compute dtype (accelerate's names): no = fp32, bf16, auto "
        "= bf16 where the device runs it natively; masters and optimizer are always FP32")
    device: str = Field("auto", description="auto (cuda when available), cpu, cuda or "
                        "cuda:N")
    train: dict[str, Any] = Field(
        default_factory=dict, description="the training policy's formats: weights, "
        "activations, gradients (each a format name), backward_operands (requantize, "
        "reuse_forward or dequantized); docs/layers.md. A whole recipe by name instead: "
        "recipe=NAME (e.g. hif4+resq-2:4, nemo-rl-nvfp4) sets train, rollout's policy and "
        "ignore")
    rollout: dict[str, Any] = Field(
        default_factory=dict, description="the rollout policy (weights, activations, "
        "recovery: docs/layers.md), the engine that runs it (rollout.engine) and each "
        "engine's own settings (rollout.<engine>: below)")
    ignore: list[str] = Field(default_factory=list, description="modules left unquantized: "
                              "regexes on module names, as in compressed-tensors, or first:N, "
                              "last:N, last:<fraction> (blocks), kind:attention, kind:mlp")
    data: DataConfig = Field(default_factory=DataConfig, description="the examples")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="GRPO's sampling, "
                             "batching, optimizer settings and loss")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig,
                                       description="the optimizer, by name")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig,
                                           description="several processes")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="evaluation during "
                             "training and by fp4rl eval")
    run: RunConfig = Field(default_factory=RunConfig, description="length, seed and "
                           "checkpoints")

    @model_validator(mode="after")
    def _recipe_is_valid(self) -> TrainConfig:
        try:
            recipe = self.recipe()
        except RecipeError as err:
            raise ValueError(str(err)) from None
        try:
            chosen = engine_name(self.rollout.get("engine", DEFAULT_ENGINE))
        except EngineError as err:
            raise ValueError(f"rollout.engine: {err}") from None
        for name in list_engines():
            if name in self.rollout and chosen not in (name, AUTO):
                raise ValueError(f"rollout.{name} configures the {name} engine, and "
                                 f"rollout.engine={chosen} runs another: drop rollout.{name} "
                                 f"or set rollout.engine={name}")
            if chosen in (name, AUTO):  # what it cannot serve fails before any loading
                settings = self.engine_settings(name)
                try:
                    get_engine(name).check_config(settings, recipe,
                                                  self.distributed.shards,
                                                  named=chosen == name)
                except UserError as err:
                    raise ValueError(str(err)) from None
        return self

    @property
    def rollout_engine(self) -> str:
        """Where the rollout runs: a registered engine's one name (an alias reads as it),
        or ``auto``."""
        return engine_name(self.rollout.get("engine", DEFAULT_ENGINE))

    def engine_settings(self, engine: str) -> BaseModel | None:
        """``rollout.<engine>`` validated by the engine's own settings model, defaults
        filled in (None for an engine that takes none); a key or value it does not know
        is one line naming it."""
        model = get_engine(engine).settings
        if model is None:
            if engine in self.rollout:
                raise ValueError(f"rollout.{engine}: the {engine} engine takes no settings")
            return None
        try:
            return model.model_validate(self.rollout.get(engine) or {})
        except ValidationError as err:
            raise ValueError(settings_problem(f"rollout.{engine}", model, err)) from None

    def engine_options(self, engine: str) -> dict[str, Any]:
        """The settings ``engine`` reads, as :class:`~fp4rl.rollout.base.RolloutSetup`
        hands them to it: its own section of ``rollout``, defaults filled in."""
        settings = self.engine_settings(engine)
        return settings.model_dump() if settings is not None else {}

    def recipe(self) -> Recipe:
        return recipe_of({"train": self.train, "rollout": self.rollout, "ignore": self.ignore})


def settings_problem(section: str, schema: type[BaseModel], err: ValidationError) -> str:
    """The first problem of ``err`` as one line: ``section.key must be ... , got ...``
    (the field's own ``must``), the unknown key and the keys there are, or what the
    model's own validator said."""
    e = err.errors()[0]
    key = str(e["loc"][0]) if e["loc"] else ""
    if e["type"] == "value_error":  # the model's own validators word their refusals
        return str(e["ctx"]["error"])
    if e["type"] == "extra_forbidden":
        return (f"{section}: unknown key(s) {[key]}; allowed: "
                f"{', '.join(schema.model_fields)}")
    if key not in schema.model_fields:
        return f"{section} must be a mapping of settings, got {e['input']!r}"
    extra = schema.model_fields[key].json_schema_extra
    must = extra.get("must") if isinstance(extra, dict) else None
    return f"{section}.{key} must be {must or e['msg']}, got {e['input']!r}"


def recipe_of(config: dict[str, Any], strict: bool = True) -> Recipe:
    """The quantization recipe of a training config (as a run saves it): its ``train``,
    ``rollout`` and ``ignore``. ``rollout.engine`` says where the rollout ran, not what
    policy it ran (nor do the engines' settings, ``rollout.<engine>``), so it is not part
    of the recipe."""
    rollout = {k: v for k, v in (config.get("rollout") or {}).items()
               if k not in ("engine", *list_engines())}
    return Recipe.from_dict({"train": config.get("train") or {}, "rollout": rollout,
                             "ignore": config.get("ignore")}, strict=strict)


__all__ = ["DataConfig", "DistributedConfig", "EvalConfig", "GRPOConfig", "OptimizerConfig",
           "RunConfig", "TrainConfig", "recipe_of", "settings_problem"]
