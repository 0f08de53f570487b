"""DataLoader workers: each records the sample it is loading, so a worker that dies (SIGKILL, a segfault in
a decoder) is reported as one line naming that sample, and a typed error raised in a worker reaches the
user as its own one line rather than wrapped in the worker's traceback.

torch reports a dead worker from its SIGCHLD handler, so the error can surface anywhere in the main thread
(often in the middle of a training step): `report_failures` therefore wraps the whole run, not the loop.
That handler keeps raising at every later SIGCHLD while the dead worker's DataLoader iterator lives, so the
report first lets go of the iterators the failed run held (and of the error that holds their frames).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import re
import signal
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

from core.errors import TorchkilnError, WorkerDied

#: the datasets most recently handed to workers, searched for the sample a dead worker was loading; held
#: strongly, since a worker may die while its loader is being shut down (a one-batch probe's, say)
_RECENT: collections.deque[TrackedSamples] = collections.deque(maxlen=8)


class TrackedSamples(Dataset):
    """`ds` with each worker's (pid, index) of the sample it is loading kept in shared memory."""

    def __init__(self, ds: Dataset, num_workers: int, *, split: str, described: Any = None) -> None:
        """Track `ds`'s loads in `num_workers` workers; `described` (default `ds`) may name an index's file
        with a `describe(i) -> str` method."""
        self.ds, self.split = ds, split
        self.described = ds if described is None else described
        self.loading = torch.full((max(1, num_workers), 2), -1, dtype=torch.long).share_memory_()
        _RECENT.append(self)

    def __len__(self) -> int:
        return len(self.ds)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        info = get_worker_info()
        if info is not None:
            # the trainer's training loader passes (index, seed) keys
            self.loading[info.id] = torch.tensor([os.getpid(), key[0] if isinstance(key, tuple) else key])
        return self.ds[key]

    def sample_of(self, pid: int) -> str | None:
        """'sample I of split S (PATH)' that the worker with `pid` was loading, if it is one of ours."""
        for slot_pid, i in self.loading.tolist():
            if slot_pid == pid and i >= 0:
                describe = getattr(self.described, "describe", None)
                path = f" ({describe(i)})" if describe is not None else ""
                return f"sample {i} of split '{self.split}'{path}"
        return None


def worker_death(err: RuntimeError) -> WorkerDied | None:
    """The one-line error for torch's report of a dead DataLoader worker, or None if `err` is not one."""
    msg = str(err)
    m = re.search(r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\)(.*)", msg)
    if m is None:
        return None
    pids = [int(p) for p in re.findall(r"\d+", m.group(1))]
    how = " ".join(m.group(2).split()).rstrip(". ") or "died"
    found = [s for ds in reversed(_RECENT) for p in pids if (s := ds.sample_of(p)) is not None]
    what = f"while loading {', '.join(found)}" if found else "(the sample it was loading is unknown)"
    return WorkerDied(
        f"a DataLoader worker (pid {', '.join(map(str, pids))}) {how} {what}; a decoder that crashes on "
        "that file or the OOM killer (SIGKILL) are the usual causes: repair or remove the file, or lower "
        "trainer.num_workers/trainer.batch_size"
    )


def unwrapped(err: TorchkilnError) -> TorchkilnError | None:
    """A typed error that torch re-raised from a worker (its message is the worker's traceback), as its own
    one line; None if `err` was not raised in a worker."""
    msg = str(err)
    if "in DataLoader worker process" not in msg:
        return None
    last = msg.rstrip().splitlines()[-1]
    return type(err)(last.split(": ", 1)[1] if ": " in last else last)


@contextlib.contextmanager
def report_failures() -> Iterator[None]:
    """Turn a dead worker, and typed errors raised in workers, into one-line typed errors."""
    died: WorkerDied | None = None
    try:
        yield
    except TorchkilnError as e:
        plain = unwrapped(e)
        if plain is None:
            raise
        raise plain from None
    except (RuntimeError, ConnectionError, EOFError) as e:
        died = _death_behind(e)
        if died is None:
            raise
        with _sigchld_held():
            # the frames hold the dead worker's iterator: freed, it leaves torch's handler's list of workers
            traceback.clear_frames(e.__traceback__)
            del e
            gc.collect()
    if died is not None:
        raise died  # outside the except block: the cleared frames must not stay attached as its context


def _death_behind(err: BaseException) -> WorkerDied | None:
    """The worker death behind `err`, if it is torch's report of one or a batch transfer that a dying
    worker broke (torch's report then follows within moments, from its SIGCHLD handler)."""
    if isinstance(err, RuntimeError):
        return worker_death(err)
    if not _RECENT:
        return None
    try:
        for _ in range(50):
            time.sleep(0.1)  # the handler raises in this thread, during the sleep
    except RuntimeError as report:
        return worker_death(report)
    # torch's handler did not report (its iterator may already be gone): a tracked worker that is dead
    # explains the broken transfer (seen 1 run in 10 on a loaded host: EOFError in rebuild_storage_fd)
    for ds in reversed(_RECENT):
        for pid, _ in ds.loading.tolist():
            if pid > 0 and not _running(pid):
                return worker_death(RuntimeError(f"DataLoader worker (pid {pid}) exited unexpectedly"))
    return None


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a killed worker its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@contextlib.contextmanager
def _sigchld_held() -> Iterator[None]:
    """SIGCHLD held back meanwhile (torch's handler would raise inside the iterators' finalizers)."""
    hold = hasattr(signal, "pthread_sigmask") and hasattr(signal, "SIGCHLD")
    if hold:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        yield
    finally:
        if hold:
            with contextlib.suppress(RuntimeError):  # a death report for a worker already reported
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
