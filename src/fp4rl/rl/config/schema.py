"""The training config's schema: one pydantic model per section, :class:`TrainConfig` the
whole. Every field carries its description, which ``fp4rl train --help-config`` prints
(:mod:`.help`). The recipe's parts are the recipe's own models (``train`` is
:class:`~fp4rl.nn.recipe.TrainPrecision`, ``rollout`` extends
:class:`~fp4rl.nn.recipe.RolloutPrecision`, whose recovery holds the method's registered
parameters model); each rollout engine's own section, ``rollout.<engine>``, is the settings
model the engine registered: a declared, typed field for the engines fp4rl ships
(``rollout.vllm``), and for an engine registered at run time its model's instance."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from fp4rl.data.synthetic import SYNTHETIC_TASKS
from fp4rl.errors import RecipeError, UserError, did_you_mean
from fp4rl.formats.nvfp4 import ScaleRule
from fp4rl.nn.recipe import Recipe, RolloutPrecision, TrainPrecision, scale_rule
from fp4rl.precision import MixedPrecision
from fp4rl.rl.grpo import LossConfig
from fp4rl.rollout.registry import (
    AUTO,
    DEFAULT_ENGINE,
    EngineError,
    auto_picks,
    check_invariant_engine,
    engine_name,
    get_engine,
    list_engines,
)
from fp4rl.rollout.vllm.settings import VLLMSettings
from fp4rl.settings import Choices, problem


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
    mismatch_tokens: Literal["all", "trained"] = Field(
        "all", description="the tokens NeMo-RL's mismatch/* metrics average over: all = every "
        "valid generated token, as NeMo-RL (on-policy, one more no-grad forward over the rows "
        "that do not train); trained = the rows that train alone (also logged as "
        "mismatch/trained/*)")

    @model_validator(mode="after")
    def _batches_divide(self) -> GRPOConfig:
        mini = self.mini_batch_size or self.batch_size
        if self.batch_size % mini:
            raise ValueError(f"grpo.batch_size ({self.batch_size}) must be a multiple of "
                             f"grpo.mini_batch_size ({mini})")
        return self


#: a value a torch.optim class takes as a keyword (eps, betas, amsgrad, foreach, ...)
OptimizerArgument = StrictBool | int | float | str | list[float] | None


class OptimizerConfig(_Section):
    """The optimizer, by the name of its ``torch.optim`` class (case-insensitive), with
    keyword arguments beyond ``lr`` and ``weight_decay`` (``grpo.learning_rate``,
    ``grpo.weight_decay``), e.g. ``{name: AdamW, kwargs: {betas: [0.9, 0.95]}}``."""

    name: str = Field("AdamW", description="a torch.optim class, by name "
                      "(case-insensitive)")
    kwargs: dict[str, OptimizerArgument] = Field(
        default_factory=dict, description="its keyword arguments beyond lr and weight_decay")


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
    """How a policy is scored: by ``fp4rl eval``, the demo's before/after scores and the
    experiments' runner. The trainer does not evaluate during training."""

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

    @model_validator(mode="before")
    @classmethod
    def _no_steps(cls, data: object) -> object:
        """``eval.steps`` (evaluate every N training steps) was never run: a config that
        asks for it is refused in one line; ``0`` (off, what every run did), as a run's
        saved ``config.yaml`` holds it, is read as the absence it meant."""
        if not isinstance(data, Mapping) or "steps" not in data:
            return data
        if data["steps"] in (0, None):
            return {k: v for k, v in data.items() if k != "steps"}
        raise ValueError(f"eval.steps={data['steps']}: the trainer does not evaluate during "
                         "training; drop eval.steps and score the saved checkpoints with "
                         "fp4rl eval --checkpoint RUN (or one of its checkpoints)")


class RunConfig(_Section):
    steps: int = Field(40, ge=1, description="RL steps of the run")
    seed: int = Field(0, description="seeds the data order, the rollouts' sampling and "
                      "any random initialization")
    save_steps: int = Field(10, ge=1, description="a checkpoint every N steps (and at the "
                            "last)")
    keep_checkpoints: int = Field(2, ge=1, description="the newest checkpoints kept")


def _engine_summaries() -> dict[str, str]:
    return {**{name: get_engine(name).summary for name in list_engines()}, AUTO: auto_picks()}


def _engine_settings() -> dict[str, type[BaseModel]]:
    """The settings model of each engine that takes some, by the engine's name."""
    return {name: model for name in list_engines()
            if (model := get_engine(name).settings) is not None}


def _plugin_sections() -> dict[str, type[BaseModel]]:
    """The settings models of the engines registered at run time, whose sections are not
    fields of :class:`RolloutConfig` (what the help prints under each one's name)."""
    return {name: model for name, model in _engine_settings().items()
            if name not in RolloutConfig.model_fields}


#: a rollout engine's name, an alias of one, or ``auto`` (:func:`auto_picks`)
EngineName = Annotated[str, Choices(lambda: [*list_engines(), AUTO], _engine_summaries)]


class RolloutConfig(RolloutPrecision):
    """``rollout``: the rollout policy (the recipe's part), the engine that runs it, and
    under ``rollout.<engine>`` the settings of each engine that takes some: ``vllm`` a
    typed section of its own; an engine registered at run time, its key validated by the
    model that engine registered."""

    #: the extra keys are the sections of engines registered at run time, each replaced
    #: by its settings model
    model_config = ConfigDict(frozen=True, extra="allow")

    #: ``rollout.<engine>`` of the engines registered at run time: what the help prints
    extra_sections: ClassVar = staticmethod(_plugin_sections)

    engine: EngineName = Field(DEFAULT_ENGINE, description="where the rollout runs")
    vllm: VLLMSettings | None = Field(
        None, description="the vllm engine's settings (rollout.engine=vllm, or auto where "
        "it picks vllm); defaults where absent")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        try:
            return engine_name(value)
        except EngineError as err:
            raise ValueError(f"rollout.engine: {err}") from None

    @model_validator(mode="after")
    def _engine_sections(self) -> RolloutConfig:
        """Each engine section given is for the engine that runs (or may run, under
        ``auto``); an extra key is a run-time engine's settings, validated by its model."""
        extra = self.__pydantic_extra__ or {}
        plugins = _plugin_sections()
        for name in extra:
            if name not in plugins:
                allowed = [*RolloutConfig.model_fields, *plugins]
                hint = (f"; the {name} engine takes no settings" if name in list_engines()
                        else did_you_mean(name, allowed))
                raise ValueError(f"rollout: unknown key(s) {[name]}{hint}; allowed: {allowed}")
        for name in _engine_settings():
            if self._section(name) is not None and self.engine not in (name, AUTO):
                raise ValueError(f"rollout.{name} configures the {name} engine, and "
                                 f"rollout.engine={self.engine} runs another: drop "
                                 f"rollout.{name} or set rollout.engine={name}")
        for name in extra:
            model = plugins[name]
            try:
                extra[name] = model.model_validate(extra[name] or {})
            except ValidationError as err:
                raise ValueError(problem(f"rollout.{name}", model, err)) from None
        return self

    @model_serializer(mode="wrap")
    def _without_absent_sections(self, handler: SerializerFunctionWrapHandler
                                 ) -> dict[str, object]:
        """An engine section not given is not written (a config as run names only the
        settings it has)."""
        data: dict[str, object] = handler(self)
        return {k: v for k, v in data.items()
                if not (v is None and k in _engine_settings())}

    def _section(self, engine: str) -> object:
        """``rollout.<engine>`` as given: a declared field's value or an extra key's."""
        if engine in RolloutConfig.model_fields:
            return getattr(self, engine)
        return (self.__pydantic_extra__ or {}).get(engine)

    def settings_of(self, engine: str) -> BaseModel | None:
        """``rollout.<engine>`` as its engine's settings model, defaults filled in (None for
        an engine that takes none)."""
        model = get_engine(engine).settings
        if model is None:
            return None
        given = self._section(engine)
        return given if isinstance(given, model) else model()

    def policy(self) -> RolloutPrecision:
        """The recipe's part: what the rollout computes, not where."""
        return RolloutPrecision(**{k: getattr(self, k) for k in RolloutPrecision.model_fields})


class TrainConfig(_Section):
    model: str = Field("smollm2-135m", description="the policy: an embedded model's name, "
                       "a local Hugging Face directory, or a Hub id ORG/NAME")
    mixed_precision: MixedPrecision = Field(
        "auto", description="the compute dtype (accelerate's names): no = fp32, bf16, auto "
        "= bf16 where the device runs it natively; masters and optimizer are always FP32")
    device: str = Field("auto", description="auto (cuda when available), cpu, cuda or "
                        "cuda:N")
    batch_invariant: bool = Field(
        False, description="on-policy to the bit: the engine's prefill and decode steps "
        "and the trainer's forwards give a token the same logits bits at any batch, "
        "padding and micro-batch size (fixed-order CPU kernels; docs/training.md)")
    weight_cache: bool = Field(
        True, description="keep each FP4 layer's quantized training weights (Q(W) along "
        "both axes, in the compute dtype) from one weight update to the next, so that the "
        "micro-batches and the old-log-prob pass do not quantize the master again; costs "
        "2 bytes per parameter per axis in bf16 (4 in fp32), reported as "
        "memory/weight_cache_gb; off under FSDP2, whose unsharded weights live for one GEMM")
    nvfp4_scale: ScaleRule = Field(
        ScaleRule.DYNAMIC, description="NVFP4 activations' FP32 second-level scale, in both "
        "policies: dynamic = amax / 2688 (the field's), pow2 = rounded up to a power of two "
        "(float noise stops at the GEMM), static = one per layer, fixed by the first forward "
        "of each weight version and shared by both policies (docs/training.md)")
    train: TrainPrecision = Field(
        default_factory=TrainPrecision, description="the training policy's formats "
        "(docs/layers.md). A whole recipe by name instead: recipe=NAME (e.g. "
        "hif4+resq-2:4, nemo-rl-nvfp4) sets train, rollout's policy and ignore")
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="the rollout policy (docs/layers.md), "
        "the engine that runs it and each engine's own settings (rollout.<engine>)")
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
        """The recipe as a whole (its ``ignore`` selectors), and what each engine that may
        run it cannot serve, refused before any loading."""
        try:
            recipe = self.recipe()
        except RecipeError as err:
            raise ValueError(str(err)) from None
        chosen = self.rollout.engine
        if self.batch_invariant:
            try:
                check_invariant_engine(chosen)
            except UserError as err:
                raise ValueError(str(err)) from None
        for name in list_engines():
            if chosen in (name, AUTO):
                try:
                    get_engine(name).check_config(self.rollout.settings_of(name), recipe,
                                                  self.distributed.shards,
                                                  named=chosen == name)
                except UserError as err:
                    raise ValueError(str(err)) from None
        return self

    def recipe(self) -> Recipe:
        recipe = Recipe(train=self.train, rollout=self.rollout.policy(), ignore=self.ignore)
        return recipe.with_nvfp4_scale(self.nvfp4_scale)


def recipe_of(config: Mapping[str, object], strict: bool = True) -> Recipe:
    """The quantization recipe of a training config (as a run saves it): its ``train``,
    ``rollout`` and ``ignore``. ``rollout.engine`` says where the rollout ran, not what
    policy it ran (nor do the engines' settings, ``rollout.<engine>``), so it is not part
    of the recipe; ``nvfp4_scale`` is."""
    section = config.get("rollout") or {}
    rollout = {k: v for k, v in section.items() if k in RolloutPrecision.model_fields} \
        if isinstance(section, Mapping) else section  # not a mapping: refused below
    recipe = Recipe.from_dict({"train": config.get("train") or {}, "rollout": rollout,
                               "ignore": config.get("ignore")}, strict=strict)
    return recipe.with_nvfp4_scale(scale_rule(config.get("nvfp4_scale") or ScaleRule.DYNAMIC))


__all__ = ["DataConfig", "DistributedConfig", "EvalConfig", "GRPOConfig", "OptimizerConfig",
           "RolloutConfig", "RunConfig", "TrainConfig", "recipe_of"]
