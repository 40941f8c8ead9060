"""The rollout-engine interface: what the trainer, ``fp4rl bench rollout``, evaluation and
the TRL plug-in ask of whichever engine samples the rollout policy.

An engine does two things. ``sync(model)`` brings it to the trainer's current weights
(nothing for an engine that runs the trainer's own module; a packed all-gather for an
FSDP rollout copy; a refit for vLLM) and returns what that moved and cost, as metrics.
``generate(chunks, seeds, sampling)`` samples one response per prompt, the prompt
``chunks[c][i]`` under the seed ``seeds[c][i]``, and returns one
:class:`~fp4rl.rollout.batch.RolloutBatch` per chunk with each sampled token's
log-probability under the distribution it was drawn from. An engine may run the chunks
one after another (fp4rl's KV-cache engine: a chunk is a micro-batch) or all in one call
(vLLM schedules them itself); the batches come back chunk by chunk either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

import torch
from pydantic import BaseModel

from fp4rl.rollout.batch import RolloutBatch, SamplingConfig

if TYPE_CHECKING:
    from fp4rl.nn.recipe import Recipe

_S = TypeVar("_S", bound=BaseModel)

ProgressFn = Callable[[int], None]
"""Called as sampling goes with the number of tokens produced since the last call."""


@dataclass(frozen=True)
class RolloutSetup:
    """What an engine needs to serve a run's rollout policy; each engine reads its part.

    ``policy`` is the module holding the rollout policy (the trainer's model, or its FSDP
    rollout copy); ``model`` the name, directory or Hub id it was loaded from (an engine
    that loads the weights itself starts from there). ``compute_dtype`` is the run's
    (float32, or bf16 under ``mixed_precision: bf16``); ``max_model_len`` is the longest
    prompt plus response; ``world_size`` the processes sharing the step's rollout;
    ``settings`` the engine's own settings as its ``settings`` model validated them
    (``rollout.vllm``: :class:`~fp4rl.rollout.vllm.settings.VLLMSettings`; None: the
    model's defaults, or an engine that takes none)."""

    model: str
    policy: torch.nn.Module
    recipe: Recipe
    compute_dtype: torch.dtype
    seed: int
    max_model_len: int
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    world_size: int = 1
    settings: BaseModel | None = None

    def settings_as(self, model: type[_S]) -> _S:
        """``settings`` as the engine's own ``model`` (:func:`settings_as`)."""
        return settings_as(self.settings, model)


def settings_as(settings: BaseModel | None, model: type[_S]) -> _S:
    """``settings`` as an engine's own ``model`` (its defaults where None): an engine reads
    its fields typed, and a section of another engine's model is refused."""
    if settings is None:
        return model()
    if not isinstance(settings, model):
        raise TypeError(f"{model.__name__} settings expected, got {type(settings).__name__}")
    return settings


class RolloutEngine(Protocol):
    """One rollout engine (see the module docstring); :mod:`fp4rl.rollout.registry` names
    the implementations."""

    #: the engine's name in ``rollout.engine`` and ``--engine``
    name: ClassVar[str]
    #: what it is, in a few words (``fp4rl train --help-config`` lists the engines so)
    summary: ClassVar[str]
    #: the model of its own settings, ``rollout.<name>`` in a training config (None: it
    #: takes none); :class:`RolloutSetup` ``settings`` hands them to it
    settings: ClassVar[type[BaseModel] | None]
    #: whether its forward is the patched model's own, whose kernels run in fixed order
    #: under ``batch_invariant``: only such an engine serves a batch-invariant run
    #: (:func:`fp4rl.rollout.registry.check_invariant_engine`)
    batch_invariant: ClassVar[bool]
    #: its rank where ``rollout.engine: auto`` picks: the highest of the engines that
    #: :meth:`serves` the run (an engine that serves every run may close the list)
    auto_priority: ClassVar[int]
    #: where ``auto`` picks it, in a few words (``fp4rl train --help-config``; "" for the
    #: engine that serves every run)
    auto_when: ClassVar[str]
    #: whether it samples the module it is given, in the caller's process, with nothing
    #: loaded of its own: a host that owns the model and its generation (the TRL
    #: plug-in's ``fp4_rollout_engine``) can run it
    samples_module: ClassVar[bool]

    @classmethod
    def serves(cls, recipe: Recipe, device: torch.device) -> bool:
        """Whether ``auto`` may pick it for ``recipe``'s rollout on ``device``: it runs
        there (its library installed, the device its own) and runs that rollout. No
        refusal: :meth:`check` words those, for an engine that is named."""

    @classmethod
    def settle(cls, settings: BaseModel | None, device: torch.device) -> BaseModel | None:
        """``settings`` (its validated section; None: its defaults) with every ``auto``
        made what it is on ``device``: the plan settles them once, where the run's device
        is known, and the engine reads them as they are (None for an engine that takes
        none)."""

    @classmethod
    def check_config(cls, settings: BaseModel | None, recipe: Recipe, shards: bool,
                     named: bool) -> None:
        """Refuse, in one line, a training config this engine could not serve, before
        anything loads and without importing the engine's own library: ``settings`` its
        validated section (an instance of its ``settings`` model, read typed with
        :func:`settings_as`; None for an engine that takes none), ``shards`` whether the
        run shards its model (FSDP2), ``named`` whether the config names this engine (else
        ``auto`` may pick it)."""

    @classmethod
    def check(cls, recipe: Recipe, device: torch.device, world_size: int) -> None:
        """Refuse, in one line, a run this engine cannot serve (before any loading)."""

    @classmethod
    def from_setup(cls, setup: RolloutSetup) -> RolloutEngine:
        """The engine serving ``setup``'s rollout policy."""

    def sync(self, model: torch.nn.Module) -> dict[str, float]:
        """Bring the engine to ``model``'s current weights; what that moved and cost."""

    def generate(self, chunks: Sequence[Sequence[Sequence[int]]],
                 seeds: Sequence[Sequence[int]], sampling: SamplingConfig,
                 progress: bool | ProgressFn = False) -> list[RolloutBatch]:
        """One response per prompt, ``chunks[c][i]`` sampled under ``seeds[c][i]``."""

    def close(self) -> None:
        """Release what the engine holds (its memory, its process groups) now, while the
        run's own process group still stands."""


def check_seeds(chunks: Sequence[Sequence[Sequence[int]]],
                seeds: Sequence[Sequence[int]]) -> None:
    """Every prompt has its seed: a row's draw must not depend on its neighbours."""
    if [len(c) for c in chunks] != [len(s) for s in seeds]:
        raise ValueError(f"chunks of {[len(c) for c in chunks]} prompts got seeds for "
                         f"{[len(s) for s in seeds]}")
