"""The CPU heap policy of a training process: on glibc, keep freed memory for reuse instead of returning it.

A training step allocates and frees the same large activation and gradient buffers every iteration. By
default glibc serves the largest from fresh `mmap`s (returned to the kernel on free) and trims the top of its
heap whenever enough of it is free, so the next step touches those buffers as new pages: one page fault
each, with the kernel zeroing the page: tens of thousands of faults a step at nanoGPT's shape in bf16, a
few percent of the step (BENCHMARKS.md § CPU heap). `retain_freed_memory` raises both of malloc's
thresholds with `mallopt`, so freed buffers stay in the process and are handed out again: the resident
memory stays at the run's peak instead of returning to the kernel between steps.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from core.errors import unknown_choice

if TYPE_CHECKING:
    import torch

    from core.device.facts import DeviceFacts

#: mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: allocations at least this large still get an mmap of their own (glibc caps the threshold lower on some
#: versions; `retain_freed_memory` then falls back to the cap, 32 MiB on 64-bit hosts)
MMAP_THRESHOLD = 1 << 30
MMAP_THRESHOLD_CAP = 32 << 20
#: free memory at the heap's top is returned to the kernel only beyond this (mallopt takes a C int)
TRIM_THRESHOLD = 2**31 - 1


def retain_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse (process-wide, idempotent); False where the C
    library has no mallopt (macOS, Windows) or refuses the settings (musl's is a stub)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError, TypeError):  # TypeError: Windows has no "the process's own" library
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    mmap_ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) or mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_CAP)
    return bool(mmap_ok and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


#: TORCHKILN_ALLOCATOR's values: the heap policy a CPU run applies
ALLOCATORS = ("retain", "system")
#: LD_PRELOAD names of allocators that replace glibc's malloc
_PRELOADED_MALLOCS = ("jemalloc", "tcmalloc", "mimalloc")


def heap_policy(facts: DeviceFacts, device: torch.device) -> tuple[str, str]:
    """(heap policy, why): "retain" for CPU training on glibc unless the user chose their own."""
    user = facts.user_env
    asked = user.get("TORCHKILN_ALLOCATOR", "").strip().lower()
    if asked and asked not in ALLOCATORS:
        raise unknown_choice("TORCHKILN_ALLOCATOR", asked, ALLOCATORS)
    if device.type != "cpu":
        return "system", "the host heap is tuned for CPU training only (where the steps' buffers live)"
    if not facts.glibc:
        return "system", "not glibc: its malloc is left as it is"
    if asked:
        return asked, f"TORCHKILN_ALLOCATOR={asked} set by the user"
    preload = next((m for m in _PRELOADED_MALLOCS if m in user.get("LD_PRELOAD", "")), None)
    if preload:
        return "system", f"{preload} preloaded by the user (LD_PRELOAD) serves malloc"
    if "glibc.malloc." in user.get("GLIBC_TUNABLES", ""):
        return "system", "malloc tuned by the user (GLIBC_TUNABLES)"
    return "retain", (
        "glibc keeps freed memory for reuse (mallopt: no trimming, mmap only from 1 GiB): otherwise every "
        "step's buffers come back as fresh pages, a page fault each (BENCHMARKS.md § CPU heap); "
        "TORCHKILN_ALLOCATOR=system keeps glibc's defaults"
    )
