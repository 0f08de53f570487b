"""The progress display: a bar over the run's optimizer steps on a terminal, nothing on a file.

Redirected to a file, a bar's `\\r` frames are noise; the loop's plain step lines (`core.logging.sinks.
MetricsLogger`, every `trainer.log_every` steps) already say where the run is, so there is no bar then.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any, TextIO

from core.logging import messages as log
from core.loop.callbacks import Callback

if TYPE_CHECKING:
    from core.loop.trainer import Trainer


class ProgressBar(Callback):
    """A tqdm bar counting optimizer steps to the run's total, when `stream` (stderr) is a terminal."""

    def __init__(self, stream: TextIO | None = None) -> None:
        """Draw on `stream` (default: stderr, read when the run starts)."""
        self.stream = stream
        self.bar: Any = None
        self._redirect: contextlib.ExitStack | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        """Open the bar at the run's step (a resumed run starts part-way)."""
        stream = self.stream or sys.stderr
        if not stream.isatty():
            return
        try:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm
        except ImportError:
            return
        self.bar = tqdm(
            total=trainer.total_steps,
            initial=trainer.state.step,
            desc="train",
            unit="step",
            file=stream,
            mininterval=1.0,
            dynamic_ncols=True,
        )
        # lines printed while the bar is up go above it: through tqdm.write, logged or printed
        self._redirect = contextlib.ExitStack()
        self._redirect.enter_context(logging_redirect_tqdm())
        previous = log.set_writer(lambda m: self.bar.write(m, file=stream))
        self._redirect.callback(log.set_writer, previous)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Advance one step; a logged row refreshes the loss and epoch shown."""
        if self.bar is None:
            return
        self.bar.update(1)
        if "train/loss" in metrics:
            self.bar.set_postfix(epoch=trainer.state.epoch + 1, loss=f"{metrics['train/loss']:.4f}")

    def close(self) -> None:
        """Remove the bar (also when a step raised: the error then gets a line of its own)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None
