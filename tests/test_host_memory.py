"""The host allocator's policy: freed memory kept, and what a benchmark records of it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fp4rl import host_memory

_PROBE = """
import ctypes, sys
from fp4rl.host_memory import keep_freed_memory, host_memory
libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
blocks = [ctypes.create_string_buffer(8 << 20) for _ in range(12)]
del blocks
info = libc.mallinfo2()
print(kept, host_memory().keeps_freed, info.arena >> 20, info.fordblks >> 20)
"""


def _probe(mode: str, env: dict[str, str] | None = None) -> list[str]:
    import os
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                         timeout=60, env={**os.environ, **(env or {})}, check=True)
    return out.stdout.split()


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc's allocator only")
def test_freed_memory_stays_with_the_process():
    """96 MB of 8 MB blocks freed: glibc's defaults hand the heap's top back (each block
    above the moving threshold was its own mapping, or the top is trimmed), the kept
    policy leaves it in the heap for the next step."""
    kept, says, arena, free = _probe("keep")
    assert kept == says == "True" and int(arena) >= 96 and int(free) >= 96
    default = _probe("default")
    assert default[:2] == ["False", "False"] and int(default[3]) < 96
    off = _probe("keep", {"FP4RL_HOST_MALLOC": "system"})
    assert off[:2] == ["False", "False"]


def test_huge_pages_are_read_from_glibc_tunables(monkeypatch):
    monkeypatch.setattr(host_memory, "_transparent_huge_pages", lambda: "madvise")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    if host_memory._glibc() is None:
        pytest.skip("glibc's allocator only")
    assert host_memory.host_memory().huge_pages.startswith("fp4rl's kernel outputs only")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
    assert host_memory.host_memory().huge_pages.startswith("every allocation")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    assert not host_memory.host_memory().huge_pages.startswith("every allocation")
    monkeypatch.setattr(host_memory, "_transparent_huge_pages", lambda: "always")
    assert host_memory.host_memory().huge_pages == "every allocation (system always)"
