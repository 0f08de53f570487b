"""The load a command starts under, measured before torch loads OpenMP (torch-free: recipes/__init__ runs it).

OpenMP reads its wait policy once, when the library loads. Its default spins at every barrier, and beside
another busy process on a small host a spinning thread holds the core the descheduled one needs: 2-thread
steps ran about 3x slower than 1 thread there, and 1.7x faster than 1 with a passive wait (BENCHMARKS.md
§ Threads under load). So a command that starts on busy CPUs waits passively; an idle start changes nothing.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path

#: CPUs other processes must keep busy at start before OpenMP is told to wait passively
BUSY_THRESHOLD = 0.5


def _jiffies() -> tuple[int, int, int]:
    """(busy, total) clock ticks of all CPUs since boot (/proc/stat) and this process's own busy ticks.

    Busy is user + system + irq + softirq + steal: nice'd time is left out (a low-priority process yields
    to us), steal kept in (a VM's neighbours take it from us)."""
    user, nice, system, idle, iowait, irq, softirq, steal = (
        int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    busy = user + system + irq + softirq + steal
    return busy, busy + nice + idle + iowait, int(own[11]) + int(own[12])


def busy_cpus(window: float = 0.1) -> float | None:
    """How many CPUs other processes keep busy, over `window` seconds (None without /proc/stat)."""
    try:
        b0, t0, o0 = _jiffies()
        time.sleep(window)
        b1, t1, o1 = _jiffies()
    except (OSError, ValueError, IndexError):
        return None
    if t1 <= t0:
        return None
    cpus = os.cpu_count() or 1  # /proc/stat's first line sums every CPU of the system, not our affinity's
    return max(0.0, (b1 - b0 - (o1 - o0)) / (t1 - t0) * cpus)


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
    if busy - siblings >= BUSY_THRESHOLD:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
