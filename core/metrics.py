"""Metrics sinks: stdout lines, `metrics.jsonl` and TensorBoard event files in the run directory."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from core.checkpoint import write_failure
from core.paths import write_text_atomic


class MetricsLogger:
    """Writes each logged dict to stdout (optionally), `metrics.jsonl` and TensorBoard."""

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool = True,
        echo: Callable[[str], None] | None = print,
        resume_step: int | None = None,
    ) -> None:
        """Open the sinks under `run_dir` (append mode, so a resumed run continues the same files); a run
        resumed from step `resume_step` first drops what was logged after it, so no step appears twice."""
        self.path, self.tb_dir = run_dir / "metrics.jsonl", run_dir / "tb"
        self.echo = echo
        self._tb: Any = None
        with self._writing(self.path):
            run_dir.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and self.path.is_file():
                _trim_rows(self.path, resume_step)
            self._file = self.path.open("a", encoding="utf-8")
        if tensorboard:
            try:  # tensorboard is optional for `core` users; the recipes install it
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                return
            _quiet_tensorboard_threads()
            purge = None if resume_step is None else resume_step + 1
            with self._writing(self.tb_dir):
                self._tb = SummaryWriter(log_dir=str(self.tb_dir), purge_step=purge)

    @contextlib.contextmanager
    def _writing(self, path: Path) -> Iterator[None]:
        """A failed write (a full disk) becomes CheckpointWriteError: one line, exit 74 from the CLI."""
        try:
            yield
        except OSError as e:
            raise write_failure(path, e, kind="metrics ", fix="the checkpoints are intact") from None

    def log(self, step: int, metrics: dict[str, float], **extra: Any) -> None:
        """Record `metrics` at optimizer step `step`."""
        row = {"step": step, "time": round(time.time(), 3), **extra, **metrics}
        with self._writing(self.path):
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._tb is not None:
            with self._writing(self.tb_dir):
                for k, v in metrics.items():
                    self._tb.add_scalar(k, v, step)
        if self.echo is not None:
            shown = " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
            self.echo(f"[step {step}] {shown}")

    def close(self) -> None:
        """Flush and close all sinks."""
        with self._writing(self.path):
            self._file.close()
        if self._tb is not None:
            tb, self._tb = self._tb, None
            with self._writing(self.tb_dir):
                tb.close()


def _quiet_tensorboard_threads() -> None:
    """TensorBoard writes events in a thread that, on an error, re-raises it to the caller's next call
    (where `MetricsLogger` makes it one line) and also lets it escape the thread, whose traceback Python
    prints: silence only that second report."""
    previous = threading.excepthook
    if getattr(previous, "torchkiln_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__module__.startswith("tensorboard.") and issubclass(args.exc_type, OSError):
            return
        previous(args)

    hook.torchkiln_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class NullLogger:
    """The metrics sink of ranks other than 0: rank 0 alone writes (after reducing across ranks)."""

    def log(self, step: int, metrics: dict[str, float], **extra: Any) -> None:
        """Drop the row."""

    def close(self) -> None:
        """Nothing to close."""


def _trim_rows(path: Path, last_step: int) -> None:
    """Rewrite `path` (JSON lines) without rows logged after `last_step`, atomically."""
    kept = [
        line
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
        if _step(line) <= last_step
    ]
    write_text_atomic(path, "".join(kept))


def _step(line: str) -> float:
    try:
        return float(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0.0  # a torn last line of a killed run: kept, as it was


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
