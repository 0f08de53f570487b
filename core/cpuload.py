"""How many CPUs other processes keep busy, from /proc/stat: torch-free, so a command can measure it before
torch loads OpenMP (recipes.cli.omp_wait), and the device probe can say what load it measured under."""

from __future__ import annotations

import os
import time
from pathlib import Path

Ticks = tuple[int, int, int]
#: other processes keeping this many CPUs busy make a host busy: a command then starts OpenMP with a passive
#: wait (recipes.cli.omp_wait), and a device probe measured meanwhile is one taken under load
BUSY_CPUS = 0.5
#: the shortest window `OthersLoad` reads the load over: /proc/stat counts 10 ms ticks, so a measurement of a
#: few ms would read any load as none
LOAD_WINDOW_S = 0.25


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity set, which honours taskset and cgroup pinning unlike
    os.cpu_count (that count, where the OS has no affinity call)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_ticks() -> Ticks | None:
    """(busy, total) clock ticks of all CPUs since boot, and the busy ticks of this process and of its
    children it has waited for; None without /proc/stat (not Linux).

    Busy is user + system + irq + softirq + steal: nice'd time is left out (a low-priority process yields
    to us), steal kept in (a VM's neighbours take it from us)."""
    try:
        user, nice, system, idle, iowait, irq, softirq, steal = (
            int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
        )
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    busy = user + system + irq + softirq + steal
    return busy, busy + nice + idle + iowait, sum(int(v) for v in own[11:15])  # utime stime cutime cstime


def others_busy(before: Ticks | None, after: Ticks | None) -> float | None:
    """CPUs kept busy by processes other than this one (and its waited-for children) between two readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    cpus = os.cpu_count() or 1  # /proc/stat's first line sums every CPU of the system, not our affinity's
    return max(0.0, (after[0] - before[0] - (after[2] - before[2])) / (after[1] - before[1]) * cpus)


def busy_cpus(window: float = 0.1) -> float | None:
    """How many CPUs other processes keep busy, over the next `window` seconds (None without /proc/stat)."""
    before = cpu_ticks()
    time.sleep(window)
    return others_busy(before, cpu_ticks())


def loaded(others: float | None) -> bool:
    """Whether other processes kept BUSY_CPUS or more CPUs busy (None, the load unknown: not loaded)."""
    return others is not None and others >= BUSY_CPUS


class OthersLoad:
    """The CPUs other processes keep busy while a `with` block runs (a measurement beside them says little),
    read over at least LOAD_WINDOW_S: leaving a shorter block waits out the rest. `cpus` is None without
    /proc/stat."""

    def __enter__(self) -> OthersLoad:
        self.cpus: float | None = None
        self._before, self._start = cpu_ticks(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(max(0.0, LOAD_WINDOW_S - (time.perf_counter() - self._start)))
        self.cpus = others_busy(self._before, cpu_ticks())
