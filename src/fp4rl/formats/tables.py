"""Constant look-up tables of the formats, one copy per device.

A format's element grid and scale codes are small constant tensors (8 to 256 values).
Indexing one with codes on another device raises on a GPU (a CPU table indexed by CUDA
codes), and copying it on every call costs a host-to-device transfer per call. A
:class:`DeviceTable` builds its values once, on the CPU where they are exact by
construction, and keeps one copy on each device that asks for it, so every encoder and
decoder reads the table on the device of the codes it looks up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class DeviceTable:
    """A constant tensor built once by ``build`` (on the CPU) and copied once per device."""

    def __init__(self, build: Callable[[], torch.Tensor]) -> None:
        self._build = build
        self._copies: dict[torch.device, torch.Tensor] = {}
        self._lock = threading.Lock()

    def on(self, device: torch.device | str) -> torch.Tensor:
        """The table on ``device`` (built or copied the first time it is asked for)."""
        device = torch.device(device)
        table = self._copies.get(device)
        if table is None:
            with self._lock:
                table = self._copies.get(device)
                if table is None:
                    cpu = self._copies.get(torch.device("cpu"))
                    if cpu is None:
                        with torch.device("cpu"):  # whatever default device is in force
                            cpu = self._build()
                        self._copies[torch.device("cpu")] = cpu
                    table = cpu.to(device)
                    self._copies[device] = table
        return table

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        """The table's entries at ``index``, looked up on ``index``'s device."""
        return self.on(index.device)[index]


def signed_table(magnitudes: tuple[float, ...]) -> DeviceTable:
    """The element table of 4-bit codes: bit 3 the sign, bits 0-2 an index into
    ``magnitudes`` (float32)."""

    def build() -> torch.Tensor:
        mags = torch.tensor(magnitudes, dtype=torch.float32)
        return torch.cat([mags, -mags])

    return DeviceTable(build)


__all__ = ["DeviceTable", "signed_table"]
