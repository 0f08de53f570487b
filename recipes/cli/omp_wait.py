"""The load a command starts under, measured before torch loads OpenMP (torch-free: recipes/__init__ runs it).

OpenMP reads its wait policy once, when the library loads. Its default spins at every barrier, and beside
another busy process on a small host a spinning thread holds the core the descheduled one needs: 2-thread
steps ran about 3x slower than 1 thread there, and 1.7x faster than 1 with a passive wait (BENCHMARKS.md
§ Threads under load). So a command that starts on busy CPUs waits passively; an idle start changes nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

from core.cpuload import BUSY_CPUS, busy_cpus


def prefer_passive_wait(env: MutableMapping[str, str] = os.environ) -> None:
    """Measure the load once and export it (TORCHKILN_BUSY_CPUS, for the device plan's thread reasons);
    where other processes keep CPUs busy, export OMP_WAIT_POLICY=PASSIVE. A user's OMP_WAIT_POLICY, an
    inherited measurement (torchrun's workers, a sweep's jobs) or an already loaded torch is left alone."""
    if "torch" in sys.modules or "TORCHKILN_BUSY_CPUS" in env or "OMP_WAIT_POLICY" in env:
        return
    busy = busy_cpus()
    if busy is None:
        return
    env["TORCHKILN_BUSY_CPUS"] = f"{busy:.2f}"
    siblings = max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1)) - 1  # ranks importing beside us
    if busy - siblings >= BUSY_CPUS:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
