"""The host allocator's policy for CPU work: what a training step's fresh buffers cost.

A CPU step allocates and frees the same buffers every step (operands, outputs, gradients
of tens of MB). glibc's ``malloc`` hands the top of its heap back to the operating system
once more than its trim threshold lies free there (the threshold follows the largest
block freed, up to 64 MB), so the next step takes those pages again as thousands of 4 KB
page faults; which steps do depends on the order of the frees, so a step's time becomes
bimodal (the FP4 linear's q_proj step on AMX: 39 ms or 53-90 ms, 2,500 faults a step on
average). :func:`keep_freed_memory` sets the thresholds once, for the whole process,
so freed memory stays with it for the next step (the fp4rl command does this at its
start; a host that runs fp4rl's layers in its own process can call it too). A block
above 32 MB still comes from, and goes back to, its own mapping: glibc allows no higher
threshold.

Huge pages are the other half: a fresh 2 MB page is one fault where 4 KB pages are 512.
fp4rl's C kernels ask for them on their own outputs; torch's allocations get them only
when glibc is told before the process starts (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``,
glibc 2.35 or later) or the system's transparent huge pages are ``always``.
:func:`host_memory` says which holds, so a benchmark states what its baseline had.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

#: ``mallopt`` parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
#: free memory kept at the top of the heap before any is handed back
TRIM_THRESHOLD = 512 << 20
#: extra memory taken with every growth of the heap, so a step's growth is one call
TOP_PAD = 64 << 20
#: blocks up to this size come from the heap (glibc's most, on 64-bit machines)
MMAP_THRESHOLD = 32 << 20
#: set to ``system`` to leave the allocator as glibc starts it
ENV = "FP4RL_HOST_MALLOC"


@dataclass(frozen=True)
class HostMemory:
    """How this process's allocator treats a step's buffers."""

    allocator: str
    keeps_freed: bool
    huge_pages: str

    def describe(self) -> str:
        kept = "freed memory kept for reuse" if self.keeps_freed else \
            "freed memory handed back to the OS (page faults on reuse)"
        return f"{self.allocator}: {kept}; huge pages: {self.huge_pages}"


_kept = False


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS, Windows): its allocator has its own policy
    version.restype = ctypes.c_char_p
    return libc


def _glibc_version(libc: ctypes.CDLL) -> str:
    return str(libc.gnu_get_libc_version().decode())


def keep_freed_memory() -> bool:
    """Keep the memory a step frees in this process for the next step (glibc: trim
    threshold 512 MB, top pad 64 MB, blocks up to 32 MB from the heap). Returns whether
    it is in effect; a no-op under another allocator or with ``FP4RL_HOST_MALLOC=system``.
    Setting the thresholds ends glibc's own moving threshold, which is why all three are
    set together."""
    global _kept
    if _kept:
        return True
    libc = None if os.environ.get(ENV, "").lower() == "system" else _glibc()
    if libc is None:
        return False
    ok = all(libc.mallopt(param, value) == 1 for param, value in
             ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
              (_M_TOP_PAD, TOP_PAD)))
    _kept = ok
    return ok


def _transparent_huge_pages() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    chosen = [w for w in text.split() if w.startswith("[")]
    return chosen[0].strip("[]") if chosen else "unknown"


def _tunables_ask_huge_pages() -> bool:
    for item in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = item.partition("=")
        if name == "glibc.malloc.hugetlb" and value.strip() in ("1", "2"):
            return True
    return False


def host_memory() -> HostMemory:
    """What this process's allocator does with a step's buffers (for benchmark records
    and ``fp4rl env``)."""
    libc = _glibc()
    thp = _transparent_huge_pages()
    if libc is None:
        return HostMemory("not glibc", False, f"system {thp}")
    if _tunables_ask_huge_pages():
        pages = f"every allocation (glibc.malloc.hugetlb; system {thp})"
    elif thp == "always":
        pages = "every allocation (system always)"
    else:
        pages = f"fp4rl's kernel outputs only (system {thp}; " \
                "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 gives torch's too)"
    return HostMemory(f"glibc {_glibc_version(libc)}", _kept, pages)
