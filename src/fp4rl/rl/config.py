"""Training configuration: a YAML file plus ``key=value`` overrides, validated with pydantic.

Top-level ``model``, ``train``, ``rollout`` and ``ignore`` are the policy and its recipe
(``rollout`` also names the engine and holds that engine's own settings: docs/architecture.md,
"Names"); the other sections configure data, GRPO, evaluation and the run. Every field
carries its description, which ``fp4rl train --help-config`` prints. GRPO option names
follow TRL's GRPOConfig (``num_generations``, ``epsilon``, ``epsilon_high``, ``beta``,
``learning_rate``) and verl where TRL has no equivalent (``loss_agg_mode``,
``tis_imp_ratio_cap``); see ``docs/training.md``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from fp4rl.data.synthetic import SYNTHETIC_TASKS
from fp4rl.errors import ConfigError, RecipeError, UserError
from fp4rl.nn.recipe import Recipe, RolloutPrecision, TrainPrecision
from fp4rl.presets import preset_path
from fp4rl.recovery import get_recovery, list_recoveries
from fp4rl.rl.grpo import LOSS_AGG_MODES, LossConfig
from fp4rl.rollout.registry import (
    AUTO,
    AUTO_PICKS,
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
        "activations, gradients (each a format name), backward_operands (requantize or "
        "reuse_forward); "
        "docs/layers.md")
    rollout: dict[str, Any] = Field(
        default_factory=dict, description="the rollout policy (weights, activations, "
        "recovery: docs/layers.md), the engine that runs it (rollout.engine) and each "
        "engine's own settings (rollout.<engine>: below)")
    ignore: list[str] = Field(default_factory=list, description="modules left unquantized "
                              "(regexes on module names), as in compressed-tensors")
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
                                                  self.distributed.strategy == "fsdp",
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


@dataclass(frozen=True)
class ConfigField:
    """One setting of the training config as ``fp4rl train --help-config`` prints it."""

    key: str
    type: str
    default: str
    description: str


def config_fields(schema: type[BaseModel] = TrainConfig, prefix: str = ""
                  ) -> list[ConfigField]:
    """Every setting of ``schema`` by dotted key, read from its fields (sections, then
    their settings; ``rollout`` with its engine and the vLLM engine's settings), so that
    what is printed is what is validated."""
    rows = []
    for name, field in schema.model_fields.items():
        key, annotation = f"{prefix}{name}", field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.append(ConfigField(key, "section", "", field.description or ""))
            rows += config_fields(annotation, f"{key}.")
            continue
        rows.append(ConfigField(key, type_name(annotation), default_text(field),
                                field.description or ""))
        if key == "train":
            rows += recipe_fields(TrainPrecision, "train.")
        if key == "rollout":
            rows += recipe_fields(RolloutPrecision, "rollout.") + engine_fields()
    return rows


def engine_fields() -> list[ConfigField]:
    """``rollout.engine`` with every registered engine's summary, then each engine's own
    settings under ``rollout.<engine>.``, from the models the engines registered."""
    engines = [get_engine(name) for name in list_engines()]
    described = "; ".join(f"{e.name}: {e.summary}" for e in engines)
    rows = [ConfigField("rollout.engine", " | ".join([*list_engines(), AUTO]), DEFAULT_ENGINE,
                        f"where the rollout runs ({described}; {AUTO}: {AUTO_PICKS})")]
    for engine in engines:
        if engine.settings is not None:
            rows += config_fields(engine.settings, f"rollout.{engine.name}.")
    return rows


def recipe_fields(part: type, prefix: str) -> list[ConfigField]:
    """The settings of one part of the recipe (its dataclass fields' ``help``); the
    recovery as its method's name and every registered method's parameters."""
    rows = []
    for f in dataclasses.fields(part):
        if f.name != "recovery":
            choices = f.metadata.get("choices")
            kind = " | ".join(choices()) if choices else str(f.type)
            rows.append(ConfigField(f"{prefix}{f.name}", kind, default_text(f),
                                    f.metadata["help"]))
            continue
        rows.append(ConfigField(f"{prefix}recovery.method", " | ".join(list_recoveries()),
                                "none", f.metadata["help"]))
        params: dict[str, tuple[dataclasses.Field[Any], list[str]]] = {}
        for method in list_recoveries():
            for p in dataclasses.fields(get_recovery(method).config_cls):
                params.setdefault(p.name, (p, []))[1].append(method)
        rows += [ConfigField(f"{prefix}recovery.{name}", str(p.type), default_text(p),
                             f"{p.metadata['help']} ({', '.join(methods)})")
                 for name, (p, methods) in params.items()]
    return rows


def type_name(annotation: Any) -> str:
    """``auto | none | ddp`` for a Literal or an enum, ``int | None``, ``list[int]``,
    ``str``."""
    if get_origin(annotation) is Annotated:  # a strict type: what it annotates
        return type_name(get_args(annotation)[0])
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return " | ".join(str(member.value) for member in annotation)
    args = get_args(annotation)
    if get_origin(annotation) is Literal:
        return " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if args and get_origin(annotation) in (Union, UnionType):
        return " | ".join(dict.fromkeys(type_name(a) for a in args))
    if args:
        return f"{annotation.__origin__.__name__}[{', '.join(type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo | dataclasses.Field[Any]) -> str:
    """The default as a ``key=value`` override writes it."""
    if isinstance(field, FieldInfo):
        value = field.get_default(call_default_factory=True)
    else:
        value = field.default
    if isinstance(value, Enum):
        return str(value.value)
    return value if isinstance(value, str) else json.dumps(value)


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


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` (value parsed as YAML) in a nested dict, in place."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not key=value (e.g. grpo.learning_rate=1e-5)")
    try:
        value = parse_value(raw) if raw else None
    except ConfigError as err:
        raise ConfigError(f"override {key}: {err}") from None
    set_path(data, key, value)


class _Loader(yaml.SafeLoader):
    """YAML as a user means it (YAML 1.2's core rules): ``1e-1`` is a float (YAML 1.1
    wants ``1.0e-1``); only true/false are booleans, so ``mixed_precision=no`` is "no";
    and ``2:4`` stays the string the paper writes (YAML 1.1 reads base-60 integers,
    ``2:4`` = 124), as do ``010`` and other numbers YAML 1.1 reads in odd bases."""


_BOOL, _INT, _FLOAT = (f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float"))
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL, _INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))
_Loader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"),
                              list("-+0123456789"))
_Loader.add_implicit_resolver(
    _FLOAT, re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?[0-9]+[eE][-+]?[0-9]+"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def parse_value(raw: str) -> Any:
    """An override's value, read as YAML with :class:`_Loader`; malformed YAML is a
    one-line :class:`ConfigError`."""
    try:
        return yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"{raw!r} is not valid YAML ({problem})") from None


def set_path(data: dict[str, Any], key: str, value: Any) -> None:
    """``data["a"]["b"]["c"] = value`` for ``key = "a.b.c"``, creating sections."""
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key!r}: {part!r} is not a section")
        node = child
    node[leaf] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                changes: dict[str, Any] | None = None) -> TrainConfig:
    """Read ``path`` (a YAML file or a preset name, see :mod:`fp4rl.presets`), apply
    ``overrides`` (``key=value``) and ``changes`` (``{"run.steps": 3}``), then validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = preset_path(path)
        try:
            data = yaml.load(p.read_text(), Loader=_Loader) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{p} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p} must hold a mapping at the top level")
    for item in overrides or []:
        apply_override(data, item)
    for key, value in (changes or {}).items():
        set_path(data, key, value)
    return validate(data)


#: settings a resumed run may change: how long it runs, how often and how many checkpoints
#: it keeps, its evaluation (which the trainer never runs) and how long a collective
#: waits. Any other change would continue the run on a different trajectory.
RESUMABLE = ("run.steps", "run.save_steps", "run.keep_checkpoints", "eval",
             "distributed.timeout_s")


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``: a config's settings by dotted key."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def changed_settings(saved: TrainConfig, requested: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """The settings ``requested`` changes from ``saved``, by dotted key, as (saved,
    requested), leaving out the :data:`RESUMABLE` ones."""
    old, new = flatten(saved.model_dump()), flatten(requested.model_dump())
    return {key: (old.get(key), new.get(key)) for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key)
            and not any(key == r or key.startswith(f"{r}.") for r in RESUMABLE)}


def describe_changes(changed: dict[str, tuple[Any, Any]]) -> str:
    """``grpo.learning_rate 1e-05 -> 0.001, ...``: what a refused resume would change."""
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items())


REMOVED_KEYS = {
    "dtype": "dtype is gone: master weights are always FP32; choose the compute dtype with "
             "mixed_precision=no|bf16|auto",
}


def _suggestion(error: Any) -> str:
    """"; did you mean X?" for an unknown key close to a field of its section."""
    if error["type"] != "extra_forbidden":
        return ""
    section: Any = TrainConfig
    for part in error["loc"][:-1]:
        annotation = section.model_fields[part].annotation if part in section.model_fields \
            else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        section = annotation
    close = difflib.get_close_matches(str(error["loc"][-1]), list(section.model_fields), n=1)
    return f"; did you mean {close[0]}?" if close else ""


def validate(data: dict[str, Any]) -> TrainConfig:
    for key, why in REMOVED_KEYS.items():
        if key in data:
            raise ConfigError(why)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"]) or "config"
            if e["type"] == "value_error":  # our validators name their keys themselves
                problems.append(str(e["ctx"]["error"]))
                continue
            problems.append(f"{where}: {e['msg']}{_suggestion(e)}")
        raise ConfigError("invalid training config: " + "; ".join(problems)) from None


__all__ = ["LOSS_AGG_MODES", "RESUMABLE", "ConfigError", "ConfigField", "DataConfig",
           "DistributedConfig", "EvalConfig", "GRPOConfig", "OptimizerConfig", "RunConfig",
           "TrainConfig", "apply_override", "changed_settings", "config_fields",
           "describe_changes", "flatten", "load_config", "set_path", "validate"]
