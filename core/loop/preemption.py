"""Preemption: the signals a scheduler sends before it ends a job, caught while training, so the loop
checkpoints after the current step, runs the handler it replaced (a scheduler's requeue) and stops."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from core.distributed import group as dgroup
from core.distributed.env import DistEnv
from core.errors import Preempted

#: what a scheduler sends before it preempts a job (SLURM: SIGTERM, or SIGUSR1/2 by sbatch --signal=USR2@N)
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, n))


class StopSignals:
    """STOP_SIGNALS received while training, acted on at the next step boundary."""

    def __init__(self) -> None:
        """No signal yet, no handler replaced."""
        #: the signal this process received (None: none)
        self.received: int | None = None
        self.outer: dict[int, Any] = {}  # the handlers ours replaced, chained after the stop

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """While the block runs, STOP_SIGNALS are recorded, not acted on; the old handlers return after it."""
        if threading.current_thread() is not threading.main_thread():
            yield  # Python delivers signals to the main thread only: nothing to install here
            return

        def record(signum: int, frame: object) -> None:
            self.received = signum

        previous = self.outer = {s: signal.signal(s, record) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def requested(self, dist: DistEnv, device: torch.device) -> bool:
        """A stop signal reached this process, or (several processes) any rank: all stop at one step."""
        if dist.distributed:
            return dgroup.any_rank(self.received is not None, device)
        return self.received is not None

    def name(self) -> str:
        """The signal's name, for the stop's one line."""
        return signal.Signals(self.received).name if self.received else "a stop signal on another rank"

    def chain(self) -> None:
        """Run the handler ours replaced (e.g. a job scheduler's requeue), once the checkpoint is written."""
        outer = self.outer.get(self.received)
        if callable(outer):
            outer(self.received, None)

    def stopped(self, step: int, checkpoint: Path | str) -> Preempted:
        """Once the stop's checkpoint is written: run the handler ours replaced (`chain`), and return the
        stop's one-line error naming the signal, the step and the `checkpoint` a resumed run continues at."""
        self.chain()
        return Preempted(
            f"{self.name()} after step {step}: checkpoint {checkpoint}; resume=auto continues there"
        )
