"""TRL's GRPO trainer running fp4rl's 4-bit policies: :class:`FP4GRPOTrainer`.

TRL's ``GRPOTrainer`` keeps the whole GRPO loop (data, rewards, advantages, loss, logging,
checkpoints); the subclass changes what the policy computes in and where completions come
from:

- the linears of every transformer block become :class:`fp4rl.nn.FP4Linear`
  (:func:`fp4rl.quantize_model`), so each forward and backward TRL runs is the recipe's
  training policy;
- completions are sampled from the recipe's rollout policy (:func:`fp4rl.rollout_mode`),
  by fp4rl's KV-cache engine or by transformers' ``generate``, together with each token's
  log-probability under the distribution it was drawn from (temperature, top-k, top-p
  applied); or, with ``use_vllm=True, vllm_mode="colocate"``, by TRL's own colocated vLLM
  engine running the fp4rl quantization method (:mod:`fp4rl.integrations.vllm`), refit
  and re-quantized before each generation round;
- TRL's importance-sampling correction for a mismatched sampler
  (``vllm_importance_sampling_correction``, ``_mode``, ``_clip_min``, ``_clip_max``) is
  applied to that rollout/training mismatch, with TRL's own code and metrics.

What it touches inside TRL, and why the version is pinned (:data:`TRL_REQUIREMENT`):

- ``_generate_single_turn`` (private, overridden): TRL's one-round generation hook. It
  returns the completions and their sampling log-probs, which TRL turns into
  ``sampling_per_token_logps``; everything around it (tokenizing, decoding, rewards) stays
  TRL's. On vLLM it refits the engine first, then calls TRL's own vLLM branch.
- ``use_vllm`` (attribute, set after TRL's constructor): TRL gates the correction on
  ``use_vllm and vllm_importance_sampling_correction``, in
  ``_generate_and_score_completions`` (pi_old, the ratio, the ``sampling/*`` metrics) and
  ``_compute_loss`` (the weighted loss). Without vLLM, ``args.use_vllm`` stays False, so
  no vLLM engine is built; the flag's other readers are the vLLM branch of
  ``_generate_single_turn`` (overridden) and the weight sync of ``rollout_func`` and the
  context limit of the tool loop, both refused here.
- With vLLM: the name ``LLM`` in ``trl.generation.vllm_generation``, which TRL's engine
  construction calls (swapped during the constructor only, to add the fp4rl method), and
  fp4rl's refit, which hands the engine the trainer's ``Q(W)`` instead of TRL's
  ``sync_weights`` (whose plain weights the engine would re-quantize in its compute dtype).

Both are private interfaces that change between TRL releases, so the module refuses a
TRL outside the tested range at import.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from packaging.requirements import Requirement
from torch import nn

from fp4rl.errors import RecipeError, UserError, did_you_mean
from fp4rl.nn import (
    Recipe,
    begin_step,
    get_recipe,
    hold_weights,
    quantize_model,
    rollout_mode,
)
from fp4rl.nn.invariant import invariant_for
from fp4rl.rollout import (
    RolloutSetup,
    SamplingConfig,
    VLLMEngine,
    check_invariant_engine,
    get_engine,
    list_engines,
)
from fp4rl.rollout.logprobs import response_logprobs
from fp4rl.rollout.mismatch import nemo_rl_mismatch
from fp4rl.rollout.registry import DEFAULT_ENGINE

#: the TRL releases this module is tested with (the ``trl`` extra of fp4rl pins the same)
TRL_REQUIREMENT = "trl>=1.16,<1.17"
#: what the import errors tell a user to run: fp4rl is installed already (it raised them),
#: so only TRL is missing, and TRL comes from PyPI, where fp4rl is not (``pip install -e
#: ".[trl]"`` in a checkout installs both)
INSTALL = f'pip install "{TRL_REQUIREMENT}"'

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
    from trl.models import unwrap_model_for_generation
    from trl.trainer.utils import pad
except ModuleNotFoundError as error:
    if error.name != "trl":
        raise
    raise ImportError(f"fp4rl.integrations.trl needs TRL ({TRL_REQUIREMENT}), which is not "
                      f"installed: {INSTALL}") from None

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel
    from trl.trainer.grpo_trainer import RewardFunc

#: ``fp4_rollout_engine``'s choice that is no rollout engine: transformers' ``generate``
TRANSFORMERS = "transformers"


def trl_engines() -> list[str]:
    """``fp4_rollout_engine``'s choices: every registered rollout engine that samples the
    module it is given in this process (``samples_module``: fp4rl's KV-cache engine,
    ``hf``, and any such engine registered), then transformers' ``generate``. An engine
    that loads weights of its own is not one: vLLM is TRL's own switch (``use_vllm``)."""
    return [*(n for n in list_engines() if get_engine(n).samples_module), TRANSFORMERS]

#: GRPOTrainer arguments this trainer cannot honour, and why
_REFUSED_ARGUMENTS = {
    "peft_config": "fp4rl trains the full FP32 master weights, not adapters",
    "tools": "only single-turn generation is supported",
    "environment_factory": "only single-turn generation is supported",
    "rollout_func": "a custom rollout would bypass the FP4 rollout policy",
}


class TRLVersionError(UserError, ImportError):
    """The installed TRL is outside the range this module is tested with."""


def check_trl_version(installed: str) -> None:
    """Refuse a TRL outside :data:`TRL_REQUIREMENT`: the trainer overrides TRL's private
    generation hook and sets an attribute TRL reads, and both change between releases."""
    if not Requirement(TRL_REQUIREMENT).specifier.contains(installed, prereleases=True):
        raise TRLVersionError(f"fp4rl.integrations.trl is tested with {TRL_REQUIREMENT}, "
                              f"but trl {installed} is installed: {INSTALL}")


check_trl_version(trl.__version__)


def resolve_recipe(recipe: Recipe | str) -> Recipe:
    """A :class:`Recipe` from a recipe name (``"hif4+resq-2:4"``) or a
    Recipe itself; an unknown name is a one-line :class:`RecipeError`."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str):
        return get_recipe(recipe)
    raise RecipeError(f"fp4_recipe must be a recipe name or a fp4rl.Recipe, "
                      f"got {type(recipe).__name__}")


def _check_engine(engine: str, args: GRPOConfig | None) -> str:
    """``engine``'s one name (one of :func:`trl_engines`), checked against ``args``'
    generation options."""
    choices = trl_engines()
    if engine not in choices:
        hint = (f": the {engine} engine loads weights of its own, which TRL does not hand "
                "it; vLLM is TRL's switch, use_vllm=True with vllm_mode='colocate'"
                if engine in list_engines() else did_you_mean(engine, choices))
        raise UserError(f"fp4_rollout_engine {engine!r} is not one of "
                        f"{', '.join(choices)}{hint}")
    if engine == TRANSFORMERS:
        return engine
    if args is None:
        return engine
    extras = {"min_p": args.min_p is not None, "repetition_penalty": args.repetition_penalty != 1,
              "generation_kwargs": bool(args.generation_kwargs)}
    chosen = [name for name, used in extras.items() if used]
    if chosen:
        raise UserError(f"{', '.join(chosen)}: fp4rl's rollout engine samples with temperature, "
                        "top_p and top_k only; pass fp4_rollout_engine='transformers' to sample "
                        "with transformers' generate, which applies them")
    return engine


def _check_config(args: GRPOConfig) -> None:
    """Refuse settings that would leave fp4rl's policies or precision policy."""
    if args.use_vllm:
        _check_vllm_config(args)
    if args.use_transformers_continuous_batching:
        raise UserError("use_transformers_continuous_batching=True casts the model for "
                        "generation; FP4GRPOTrainer generates with its own rollout, set it False")
    if args.fp16:
        raise UserError("fp16=True: fp4rl computes in bf16 (bf16=True) or fp32 (bf16=False), "
                        "always with FP32 master weights")
    token_modes = ("token_truncate", "token_mask")
    if args.loss_type == "vespo" and args.vllm_importance_sampling_correction and \
            args.vllm_importance_sampling_mode not in token_modes:
        raise UserError(f"loss_type='vespo' needs vllm_importance_sampling_mode in "
                        f"{', '.join(token_modes)}, got {args.vllm_importance_sampling_mode!r}")


def _check_vllm_config(args: GRPOConfig) -> None:
    """Refuse the vLLM settings under which the engine would sample from stale weights
    (its ``Q(W)`` is re-taken by this trainer's refit only) or run untested sharding."""
    if args.vllm_mode != "colocate":
        raise UserError(f"vllm_mode={args.vllm_mode!r}: FP4GRPOTrainer rolls out in a "
                        "colocated engine that it refits and re-quantizes every step; set "
                        "vllm_mode='colocate'")
    if args.vllm_enable_sleep_mode:
        raise UserError("vllm_enable_sleep_mode=True: waking the engine reloads weights "
                        "without re-quantizing them; set it False")
    if args.vllm_tensor_parallel_size != 1:
        raise UserError(f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size}: the "
                        "fp4rl method is tested with 1; run one engine per process "
                        "(vllm_tensor_parallel_size=1)")


@contextlib.contextmanager
def _engine_with_fp4rl_method(recipe: Recipe, args: GRPOConfig) -> Iterator[None]:
    """While TRL's constructor runs, its colocated engine is built with the fp4rl method
    for ``recipe`` and the trainer's compute dtype. TRL calls ``LLM(...)`` by the name it
    imported into ``trl.generation.vllm_generation``; that name is swapped for the
    constructor's duration only.

    On CPU the engine runs eagerly, as fp4rl's own does, and its KV cache is 1 GiB, split
    between the engines of a launched run on one machine: there vLLM reads
    ``vllm_gpu_memory_utilization`` as a share of the machine's RAM, which the trainer in
    the same process needs (``VLLM_CPU_KVCACHE_SPACE``, in GiB, sets another)."""
    from trl.generation import vllm_generation

    from fp4rl.integrations import vllm as fp4vllm

    # registering the method needs vLLM: without it, one line naming the install (and TRL
    # imported no LLM to swap)
    extra: dict[str, object] = {**fp4vllm.method_kwargs(recipe),
                             "dtype": torch.bfloat16 if args.bf16 else torch.float32}
    if args.use_cpu or not torch.cuda.is_available():
        extra["enforce_eager"] = True
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            extra["kv_cache_memory_bytes"] = fp4vllm.default_kv_cache_bytes(
                torch.device("cpu"))
    build = vllm_generation.LLM

    def llm_with_fp4rl(**kwargs: object) -> object:
        with fp4vllm.one_line_refusals():  # a recipe vLLM refuses: one line, not pydantic's
            return build(**{**kwargs, **extra})

    vllm_generation.LLM = llm_with_fp4rl
    try:
        with fp4vllm.sharing_the_process():
            yield
    finally:
        vllm_generation.LLM = build


def _check_arguments(kwargs: Mapping[str, object]) -> None:
    for name, reason in _REFUSED_ARGUMENTS.items():
        if kwargs.get(name) is not None:
            raise UserError(f"FP4GRPOTrainer does not take {name}: {reason}")


def _require_fp32_masters(model: nn.Module) -> None:
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point()})
    if dtypes != [str(torch.float32)]:
        raise UserError(f"the model's parameters are {', '.join(dtypes)}: fp4rl keeps FP32 "
                        "master weights (bf16=True computes in bf16 under autocast); load the "
                        "model in float32")


def _trim(tokens: torch.Tensor, logprobs: torch.Tensor,
          lengths: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's first ``length`` token ids and log-probs, as the lists TRL takes."""
    n = lengths.tolist()
    return ([row[:k] for row, k in zip(tokens.tolist(), n, strict=True)],
            [row[:k] for row, k in zip(logprobs.tolist(), n, strict=True)])


def _lengths_through_eos(tokens: torch.Tensor, eos_token_ids: Sequence[int]) -> torch.Tensor:
    """Tokens up to and including each row's first end token (all of them if none), which
    is what TRL counts as the completion."""
    is_eos = torch.isin(tokens, torch.tensor(list(eos_token_ids), device=tokens.device))
    first = is_eos.int().argmax(dim=1) + 1
    return torch.where(is_eos.any(dim=1), first, tokens.shape[1])


def sample_with_fp4rl(model: nn.Module, prompt_ids: Sequence[Sequence[int]],
                      config: SamplingConfig, pad_token_id: int,
                      eos_token_ids: Sequence[int], *, engine: str = DEFAULT_ENGINE,
                      recipe: Recipe | None = None
                      ) -> tuple[list[list[int]], list[list[float]]]:
    """One completion per prompt from the fp4rl engine ``engine`` sampling ``model`` (one
    of :func:`trl_engines`: fp4rl's KV-cache engine, ``hf``, by default), with each
    token's log-prob under the filtered distribution it was drawn from. Each row's seed is
    drawn from torch's global generator, so TRL's ``seed`` fixes the completions.
    ``recipe`` is the policy's, for an engine that reads it (None: the module's patched
    layers hold it, which is what an engine that samples the module runs)."""
    seeds = torch.randint(0, 2**62, (len(prompt_ids),)).tolist()
    longest = max(map(len, prompt_ids), default=0) + config.max_new_tokens
    setup = RolloutSetup(model=str(getattr(getattr(model, "config", None), "_name_or_path",
                                           "")),
                         policy=model, recipe=recipe or Recipe(),
                         compute_dtype=torch.float32, seed=0, max_model_len=longest,
                         pad_token_id=pad_token_id, eos_token_ids=tuple(eos_token_ids))
    [batch] = get_engine(engine).from_setup(setup).generate([prompt_ids], [seeds], config)
    return _trim(batch.response_ids, batch.logprobs, batch.response_lengths())


def sample_with_transformers(model: PreTrainedModel, prompt_ids: Sequence[Sequence[int]],
                             generation_config: GenerationConfig, pad_token_id: int,
                             eos_token_ids: Sequence[int]
                             ) -> tuple[list[list[int]], list[list[float]]]:
    """One completion per prompt from transformers' ``generate``. Its ``scores`` are the
    logits after every processor and warper (temperature, top-k, top-p, min-p, repetition
    penalty), so their log-softmax is the distribution each token was drawn from."""
    device = next(model.parameters()).device
    rows = [torch.tensor(p, dtype=torch.long) for p in prompt_ids]
    ids = pad(rows, padding_value=pad_token_id, padding_side="left").to(device)
    mask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="left")
    out = model.generate(  # type: ignore[operator]  # GenerationMixin's, on causal LMs
                         input_ids=ids, attention_mask=mask.to(device),
                         generation_config=generation_config, output_scores=True,
                         return_dict_in_generate=True)
    tokens = out.sequences[:, ids.shape[1]:]
    with invariant_for(model):  # the scorer's kernel, where the policy is batch-invariant
        logp = torch.stack(out.scores, dim=1).float().log_softmax(dim=-1)
    logprobs = logp.gather(-1, tokens[..., None]).squeeze(-1)
    return _trim(tokens, logprobs, _lengths_through_eos(tokens, eos_token_ids))


class FP4GRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` whose training and rollout policies are fp4rl's 4-bit ones.

    ``model``, ``reward_funcs`` and ``args`` are GRPOTrainer's; its other arguments
    (``train_dataset``, ``processing_class``, ...) go by keyword. ``fp4_recipe`` is a
    recipe name (``"hif4+resq-2:4"``) or a :class:`fp4rl.Recipe`;
    ``fp4_rollout_engine`` picks fp4rl's KV-cache engine (temperature, top_p, top_k) or
    transformers' ``generate`` (every generation option of GRPOConfig). With
    ``use_vllm=True, vllm_mode="colocate"`` in ``args``, TRL's colocated vLLM engine
    samples instead, running the recipe's rollout policy through the fp4rl quantization
    method in the run's compute dtype; it is refit before every generation round
    (``time/refit``, ``sync/bytes`` are logged) and its log-probs are the mu of TRL's
    correction.

    The precision policy is fp4rl's: master weights and AdamW stay FP32, and
    ``bf16=True`` runs training and rollout under accelerate's bf16 autocast, which FP4
    layers follow (their operands are exact in bf16). If ``beta > 0``, TRL's reference
    model gets the same recipe, so the KL compares two training policies.

    ``fp4_batch_invariant=True`` makes the policy on-policy to the bit (docs/training.md):
    fp4rl's engine (or ``generate``) and TRL's scoring give a sampled token the same
    log-prob bits, so TRL's ``sampling/*`` and NeMo-RL's ``mismatch/*`` measure the recipe's
    designed mismatch alone.
    """

    args: GRPOConfig  # GRPOTrainer's arguments (its stubs say TrainingArguments)

    def __init__(self, model: str | PreTrainedModel,
                 reward_funcs: RewardFunc | list[RewardFunc] | None = None,
                 args: GRPOConfig | None = None, *, fp4_recipe: Recipe | str,
                 fp4_rollout_engine: str = DEFAULT_ENGINE, fp4_batch_invariant: bool = False,
                 **kwargs: Any) -> None:
        recipe = resolve_recipe(fp4_recipe)
        on_vllm = args is not None and args.use_vllm
        # vLLM's sampler applies every generation option of GRPOConfig
        engine = _check_engine(fp4_rollout_engine, None if on_vllm else args)
        used = VLLMEngine.name if on_vllm else engine  # TRL's vLLM is fp4rl's vllm engine
        if fp4_batch_invariant and used != TRANSFORMERS:  # fp4rl's rule, in TRL's words
            check_invariant_engine(used, "fp4_batch_invariant=True",
                                   "set fp4_rollout_engine to {fit}, or transformers")
        self.fp4_batch_invariant = fp4_batch_invariant
        if args is not None:
            _check_config(args)
        if on_vllm:
            from fp4rl.integrations.vllm import rollout_recipe

            rollout_recipe(recipe)  # one line if vLLM cannot run its recovery method
        _check_arguments(kwargs)
        with _engine_with_fp4rl_method(recipe, cast("GRPOConfig", args)) if on_vllm else \
                contextlib.nullcontext():
            super().__init__(model, reward_funcs, args, **kwargs)
        self.fp4_recipe = recipe
        self.fp4_rollout_engine = used
        self._patch_policies(recipe)
        # TRL applies its sampler-mismatch correction only under this flag (see the module
        # docstring); unless args.use_vllm, TRL built no vLLM engine.
        self.use_vllm = True

    def _patch_policies(self, recipe: Recipe) -> None:
        policy = self.accelerator.unwrap_model(self.model)
        _require_fp32_masters(policy)
        invariant = self.fp4_batch_invariant
        # under FSDP or DeepSpeed the weights are gathered for one GEMM: keep no Q(W)
        # between GEMMs there (docs/layers.md, weight_cache)
        keep = self.accelerator.distributed_type.name not in ("FSDP", "DEEPSPEED", "MEGATRON_LM")
        quantize_model(policy, recipe, batch_invariant=invariant, weight_cache=keep)
        if self.ref_model is not None:
            quantize_model(self.accelerator.unwrap_model(self.ref_model), recipe,
                           batch_invariant=invariant, weight_cache=keep)

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """TRL's training step (a generation round where one is due, then a micro-batch's
        forward and backward) with the policy's weights held (:func:`fp4rl.nn.hold_weights`):
        the FP4 layers quantize each weight once for the round's decode steps, its scoring
        and the micro-batch, and keep nothing between steps, where a callback or a PEFT
        merge may write the weights through ``.data``."""
        with hold_weights(self.accelerator.unwrap_model(self.model)):
            loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
        return loss

    def _get_per_token_logps_and_entropies(
            self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            logits_to_keep: int, batch_size: int | None = None, compute_entropy: bool = False,
            compute_aux_loss: bool = False, **multimodal: object
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's scoring; where the policy is batch-invariant, fp4rl's trainer's instead
        (``fp4rl.rl.logprobs.response_logprobs``: positions from the attention mask, the
        logits divided by the temperature, one log-softmax), which gives a sampled token
        the engine's bits. TRL's own path (a fused head folding vocabulary tiles into an
        online log-sum-exp, the logits multiplied by ``1 / T``) computes the same value in
        another order, and so other last bits."""
        if not self.fp4_batch_invariant or compute_aux_loss or \
                any(v is not None for v in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size,
                compute_entropy, compute_aux_loss, **multimodal)
        size = batch_size or input_ids.size(0)
        width = input_ids.size(1) - logits_to_keep
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), size):
            with self.accelerator.autocast():
                logp, entropy = response_logprobs(
                    model, input_ids[start:start + size], attention_mask[start:start + size],
                    width, self.temperature, with_entropy=compute_entropy)
            logps.append(logp)
            if entropy is not None:
                entropies.append(entropy)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    @contextlib.contextmanager
    def _rollout_policy(self) -> Iterator[nn.Module]:
        """The unwrapped model as the rollout policy. The compute dtype is set here, as TRL
        sets it for its own forwards, rather than left to the autocast wrapper accelerate
        puts on a prepared model's forward (absent before ``train()``, e.g. for an
        ``evaluate()`` first). TRL's unwrapping also pauses gradient checkpointing, which
        would turn the KV cache off."""
        with (unwrap_model_for_generation(
                  self.model_wrapped, self.accelerator,
                  gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                  # a str (JSON) only until TrainingArguments.__post_init__ parses it
                  gradient_checkpointing_kwargs=cast(
                      "dict[str, Any] | None", self.args.gradient_checkpointing_kwargs))
              as policy, torch.no_grad(), rollout_mode(policy), self.accelerator.autocast()):
            begin_step(policy)  # one generation round is one RL step: recalibrate recovery
            yield policy

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's rollout and scoring, then NeMo-RL's mismatch metrics of the same tokens
        (:func:`fp4rl.rollout.mismatch.nemo_rl_mismatch`) beside TRL's ``sampling/*`` ones."""
        output = super()._generate_and_score_completions(inputs)
        old, sampled = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
        if old is None or sampled is None:
            return output
        diff = (old - sampled)[output["completion_mask"].bool()]
        diff = diff[~torch.isnan(diff)]  # tokens a sampler could not score, as TRL skips them
        assert self.model is not None  # set by the trainer's constructor
        mode = "train" if self.model.training else "eval"
        for key, value in nemo_rl_mismatch(diff).items():  # NaN where no token: every
            gathered = self.accelerator.gather(value.reshape(1))  # process gathers alike
            self._metrics[mode][key].append(gathered.nanmean().item())
        return output

    def _generate_single_turn(self, prompt_ids: list[list[int]], images: object,
                              multimodal_fields: dict[str, object], num_generations: int,
                              has_tool_images: bool = False
                              ) -> tuple[list[list[int]], list[list[float]]]:
        """TRL's generation hook: one completion per prompt row (TRL has already repeated
        each prompt ``num_generations`` times) from the rollout policy, and each token's
        log-prob under the distribution it was sampled from, which TRL keeps as
        ``sampling_per_token_logps`` and compares with the training policy's pi_old."""
        if images is not None or multimodal_fields:
            raise UserError("FP4GRPOTrainer samples text-only prompts; this batch has images")
        if self.args.use_vllm:
            self._refit_engine()
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields,
                                                 num_generations, has_tool_images)
        pad_token_id = self.generation_config.pad_token_id
        with self._rollout_policy() as policy:
            if self.fp4_rollout_engine == TRANSFORMERS:
                return sample_with_transformers(cast("PreTrainedModel", policy), prompt_ids,
                                                self.generation_config, pad_token_id,
                                                self.eos_token_ids)
            return sample_with_fp4rl(policy, prompt_ids, self._sampling_config(),
                                     pad_token_id, self.eos_token_ids,
                                     engine=self.fp4_rollout_engine, recipe=self.fp4_recipe)

    def _refit_engine(self) -> None:
        """Hand TRL's colocated engine ``Q(W)`` of the step's weights (and the other
        tensors) before TRL's own generation, which then finds the engine up to date and
        only samples; the refit time and bytes are logged with TRL's metrics."""
        if self.state.global_step == self._last_loaded_step:
            return
        from fp4rl.rollout import VLLMEngine
        from fp4rl.rollout.vllm.config import RefitWire

        # TRL samples itself; the engine here only syncs (pad and stop ids as TRL's own)
        engine = VLLMEngine(self.vllm_generation.llm, self._tokenizer.pad_token_id,
                            self.eos_token_ids, refit_wire=RefitWire.BF16)
        metrics = engine.sync(self.accelerator.unwrap_model(self.model))
        self._last_loaded_step = self.state.global_step
        assert self.model is not None  # set by the trainer's constructor
        mode = "train" if self.model.training else "eval"
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    def _sampling_config(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k or 0,
                              # GRPOTrainer sets it from GRPOConfig's (default 256)
                              max_new_tokens=cast(int, self.max_completion_length))


__all__ = ["INSTALL", "TRANSFORMERS", "TRL_REQUIREMENT", "FP4GRPOTrainer", "TRLVersionError",
           "check_trl_version", "resolve_recipe", "sample_with_fp4rl",
           "sample_with_transformers", "trl_engines"]
