"""A CPU platform for verl, registered through verl's own ``PlatformRegistry``.

verl 0.9.1 ships CUDA, NPU and ROCm platforms and falls back to CUDA where none is found;
its weight sender then asks ``torch.cuda`` to synchronize. This platform is the one piece
of these tests that stands in for what verl lacks: the device module is ``torch.cpu`` with
a no-op ``empty_cache``, IPC is off (so verl's own shared-memory path carries buckets),
and the collective backend is gloo."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

DEVICE_MODULE = SimpleNamespace(synchronize=torch.cpu.synchronize, empty_cache=lambda: None,
                                current_device=lambda: 0, device_count=lambda: 1,
                                is_available=lambda: True, manual_seed=torch.manual_seed,
                                manual_seed_all=torch.manual_seed,
                                memory_allocated=lambda *a: 0, memory_reserved=lambda *a: 0,
                                max_memory_allocated=lambda *a: 0,
                                mem_get_info=lambda *a: (0, 0))


class CPUPlatform(PlatformBase):
    """verl's platform interface on the CPU."""

    device_name = "cpu"
    vendor_name = "cpu"

    @property
    def device_module(self) -> ModuleType:
        return DEVICE_MODULE  # type: ignore[return-value]

    def is_available(self) -> bool:
        return True

    def current_device(self) -> torch.device:  # type: ignore[override]
        """verl moves modules to ``current_device()`` (``model.to(device=0)`` means CUDA)."""
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        del device_index

    def synchronize(self, device_index: int | None = None) -> None:
        del device_index

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        del settings

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def install() -> None:
    """Register the platform under ``cpu`` and make it verl's current one."""
    PlatformRegistry.register("cpu")(CPUPlatform)
    set_platform(CPUPlatform())
