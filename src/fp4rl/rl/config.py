"""Training configuration: a YAML file plus ``key=value`` overrides, validated with pydantic.

Top-level ``model``, ``train`` and ``rollout`` are the recipe of ``docs/design``; the other
sections configure data, GRPO, evaluation and the run. GRPO option names follow TRL's
GRPOConfig (``num_generations``, ``epsilon``, ``epsilon_high``, ``beta``,
``learning_rate``) and verl where TRL has no equivalent (``loss_agg_mode``,
``tis_imp_ratio_cap``); see ``docs/training.md``.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fp4rl.data.synthetic import SYNTHETIC_TASKS
from fp4rl.errors import ConfigError, RecipeError
from fp4rl.nn.recipe import Recipe
from fp4rl.presets import preset_path
from fp4rl.rl.grpo import LOSS_AGG_MODES, LossConfig
from fp4rl.rollout.registry import EngineError, engine_name
from fp4rl.rollout.vllm.config import WEIGHT_STORAGES, VLLMError, rollout_recipe

#: the keys of ``rollout.vllm``: ``weight_storage`` as in the vLLM method's config,
#: ``refit_wire``, how ``Q(W)`` travels to the engine (the format's packed codes and
#: scales, or its values in bf16), ``refit_piece_bytes``, the bound on one refit message,
#: ``kv_cache_bytes``, each engine's KV cache (default: 1 GiB on a CPU, vLLM's share of
#: the GPU on GPUs), ``gpu_memory_utilization``, that share, and ``enforce_eager``
#: (``auto``: eager on CPU, CUDA graphs and torch.compile on GPUs)
VLLM_KEYS = ("weight_storage", "refit_wire", "refit_piece_bytes", "kv_cache_bytes",
             "gpu_memory_utilization", "enforce_eager")
REFIT_WIRES = ("packed", "bf16")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    #: synthetic (arithmetic), synthetic-words (word problems), or a layout: gsm8k,
    #: math500, aime24, ... dapo
    source: str = "synthetic"
    train_path: str | None = None
    test_path: str | None = None
    levels: list[int] = Field(default_factory=lambda: [1, 2])  # synthetic task levels
    train_size: int = Field(2000, ge=1)
    test_size: int = Field(200, ge=1)
    template: str | None = None  # prompt template name (default: the layout's)
    fields: dict[str, str] | None = None  # field mapping for AIME/AMC-style releases
    strict: bool = False  # refuse (instead of skip) malformed rows
    reward: str | None = None  # default: the layout's reward

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

    num_generations: int = Field(8, ge=2)  # G, the group size
    batch_size: int = Field(8, ge=1)  # prompts per RL step
    mini_batch_size: int | None = Field(None, ge=1)  # prompts per optimizer step
    micro_batch_size: int = Field(16, ge=1)  # sequences per forward/backward
    ppo_epochs: int = Field(1, ge=1)
    learning_rate: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_prompt_length: int = Field(512, ge=1)
    max_response_length: int = Field(256, ge=1)

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

    name: str = "AdamW"
    kwargs: dict[str, Any] = Field(default_factory=dict)


class DistributedConfig(_Section):
    """Several processes (launched by torchrun or accelerate) on torch.distributed."""

    #: auto: ddp when launched on several processes, none on one
    strategy: Literal["auto", "none", "ddp", "fsdp"] = "auto"
    #: auto: nccl on CUDA, gloo on CPU
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    #: seconds a collective waits before failing (a dead rank ends the run, not hangs it)
    timeout_s: float = Field(600.0, gt=0)


class EvalConfig(_Section):
    steps: int = Field(0, ge=0)  # evaluate every N steps during training (0: off)
    size: int | None = Field(None, ge=1)  # test prompts (default: data.test_size)
    mean_at_k: int = Field(1, ge=1)  # 1: greedy Mean@1; k > 1: Mean@k sampled
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int | None = Field(None, ge=1)  # default: grpo.max_response_length
    #: seed that draws the synthetic test prompts (default: run.seed); fixing it scores
    #: every seed of a multi-seed grid on the same prompts, so they can be paired
    prompt_seed: int | None = Field(None, ge=0)


class RunConfig(_Section):
    steps: int = Field(40, ge=1)
    seed: int = 0
    save_steps: int = Field(10, ge=1)
    keep_checkpoints: int = Field(2, ge=1)


class TrainConfig(_Section):
    model: str = "smollm2-135m"
    #: compute dtype (accelerate's name): "no" = fp32, "bf16", "auto" = bf16 where native.
    #: Master weights and optimizer state are always FP32.
    mixed_precision: Literal["no", "bf16", "auto"] = "auto"
    #: "auto" (cuda when available), "cpu", "cuda" or "cuda:N"
    device: str = "auto"
    train: dict[str, Any] = Field(default_factory=dict)
    rollout: dict[str, Any] = Field(default_factory=dict)
    #: modules left unquantized (regexes on module names), as in compressed-tensors
    ignore: list[str] = Field(default_factory=list)
    data: DataConfig = Field(default_factory=DataConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _recipe_is_valid(self) -> TrainConfig:
        try:
            self.recipe()
        except RecipeError as err:
            raise ValueError(str(err)) from None
        try:
            engine_name(self.rollout.get("engine", "hf"))
        except EngineError as err:
            raise ValueError(f"rollout.engine: {err}") from None
        unknown = sorted(set(self.rollout.get("vllm") or {}) - set(VLLM_KEYS))
        if unknown:
            raise ValueError(f"rollout.vllm: unknown key(s) {unknown}; allowed: "
                             f"{', '.join(VLLM_KEYS)}")
        for key in ("kv_cache_bytes", "refit_piece_bytes"):
            n = self.vllm_settings().get(key, 1)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"rollout.vllm.{key} must be a positive integer (bytes), "
                                 f"got {n!r}")
        share = self.vllm_settings().get("gpu_memory_utilization", 0.5)
        if isinstance(share, bool) or not isinstance(share, int | float) or \
                not 0 < share <= 1:
            raise ValueError("rollout.vllm.gpu_memory_utilization must be a share of the "
                             f"GPU's memory in (0, 1], got {share!r}")
        eager = self.vllm_settings().get("enforce_eager", "auto")
        if eager != "auto" and not isinstance(eager, bool):
            raise ValueError("rollout.vllm.enforce_eager must be auto, true or false")
        for key, allowed in (("weight_storage", WEIGHT_STORAGES), ("refit_wire", REFIT_WIRES)):
            if self.vllm_settings().get(key, allowed[0]) not in allowed:
                raise ValueError(f"rollout.vllm.{key} must be one of {', '.join(allowed)}")
        if self.vllm_settings()["weight_storage"] == "packed" and \
                self.vllm_settings()["refit_wire"] != "packed":
            raise ValueError("rollout.vllm.weight_storage=packed keeps the 4-bit codes it is "
                             "sent: set rollout.vllm.refit_wire=packed")
        if self.rollout_engine == "vllm":  # what vLLM cannot run fails before any loading
            try:
                rollout_recipe(self.recipe())
            except VLLMError as err:
                raise ValueError(str(err)) from None
        return self

    @property
    def rollout_engine(self) -> str:
        """Where the rollout runs: ``hf`` (fp4rl's KV-cache engine on the trainer's model)
        or ``vllm`` (a colocated vLLM engine with the fp4rl quantization method); an alias
        (``fp4rl``) reads as the engine's one name."""
        return engine_name(self.rollout.get("engine", "hf"))

    def vllm_settings(self) -> dict[str, Any]:
        """``rollout.vllm``: how the vLLM engine keeps and receives ``Q(W)``, defaults
        filled in."""
        return {"weight_storage": WEIGHT_STORAGES[0], "refit_wire": REFIT_WIRES[0],
                **(self.rollout.get("vllm") or {})}

    def recipe(self) -> Recipe:
        return recipe_of({"train": self.train, "rollout": self.rollout, "ignore": self.ignore})


def recipe_of(config: dict[str, Any], strict: bool = True) -> Recipe:
    """The quantization recipe of a training config (as a run saves it): its ``train``,
    ``rollout`` and ``ignore``. ``rollout.engine`` says where the rollout ran, not what
    policy it ran (nor do the engine's settings, ``rollout.vllm``), so it is not part of
    the recipe."""
    rollout = {k: v for k, v in (config.get("rollout") or {}).items()
               if k not in ("engine", "vllm")}
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


__all__ = ["LOSS_AGG_MODES", "RESUMABLE", "ConfigError", "DataConfig", "DistributedConfig",
           "EvalConfig", "GRPOConfig", "OptimizerConfig", "RunConfig", "TrainConfig",
           "apply_override", "changed_settings", "describe_changes", "flatten", "load_config",
           "set_path", "validate"]
