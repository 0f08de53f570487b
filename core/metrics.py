"""Metrics sinks: stdout lines, `metrics.jsonl` and TensorBoard event files in the run directory."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Writes each logged dict to stdout (optionally), `metrics.jsonl` and TensorBoard."""

    def __init__(
        self, run_dir: Path, *, tensorboard: bool = True, echo: Callable[[str], None] | None = print
    ) -> None:
        """Open the sinks under `run_dir` (append mode, so a resumed run continues the same files)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self.echo = echo
        self._tb: Any = None
        if tensorboard:
            try:  # tensorboard is optional for `core` users; the recipes install it
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))
            except ImportError:
                self._tb = None

    def log(self, step: int, metrics: dict[str, float], **extra: Any) -> None:
        """Record `metrics` at optimizer step `step`."""
        row = {"step": step, "time": round(time.time(), 3), **extra, **metrics}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        if self.echo is not None:
            shown = " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
            self.echo(f"[step {step}] {shown}")

    def close(self) -> None:
        """Flush and close all sinks."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
