"""Metrics sinks (`Logger` callbacks): the loop's own `metrics.jsonl` with a line per row, TensorBoard, CSV.

The third-party trackers (W&B, MLflow) are in `core.logging.trackers`."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import ConfigError
from core.files import write_failure, write_text_atomic
from core.logging.messages import say
from core.loop.callbacks import Callback

if TYPE_CHECKING:
    from core.loop.trainer import Trainer


class Logger(Callback):
    """A metrics sink: gets every logged row (training windows and evaluations) and, once, the run's
    hyperparameters; subclasses write them somewhere (a file, TensorBoard, a tracking service)."""

    def log(self, step: int, metrics: dict[str, float], **extra: Any) -> None:
        """Record `metrics` at optimizer step `step`."""

    def log_hparams(self, params: dict[str, Any]) -> None:
        """Record the run's resolved configuration (flat `section.key` names), once at the start."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """Open the sink at the run's position (a resumed run first drops rows logged after it), then
        record the hyperparameters the trainer was given."""
        self.open(trainer.run_dir, resume_step=trainer.state.step if trainer.resumed else None)
        if trainer.hparams:
            self.log_hparams(trainer.hparams)

    def open(self, run_dir: Path, resume_step: int | None) -> None:
        """Open the sink under `run_dir`."""

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Record a training window's row."""
        if metrics:
            self.log(trainer.state.step, metrics, epoch=trainer.state.epoch)

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Record an evaluation's row."""
        self.log(trainer.state.step, metrics, epoch=trainer.state.epoch)


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """A failed write (a full disk) becomes CheckpointWriteError: one line, exit 74 from the CLI."""
    try:
        yield
    except OSError as e:
        raise write_failure(path, e, kind="metrics ", fix="the checkpoints are intact") from None


class MetricsLogger(Logger):
    """The loop's own record: each row to `metrics.jsonl` (which sweeps, curves and resume read) and, as a
    plain line, to the user (`[step 40/300] train/loss=...`)."""

    def __init__(self, *, echo: Callable[[str], None] | None = say, total_steps: int = 0) -> None:
        """`echo`: where each row's line goes (None: nowhere); `total_steps`: shown beside the step."""
        self.echo, self.total_steps = echo, total_steps
        self._file: Any = None

    def on_fit_start(self, trainer: Trainer) -> None:
        """Learn the run's length for the lines, then open `metrics.jsonl`."""
        self.total_steps = trainer.total_steps
        super().on_fit_start(trainer)

    def open(self, run_dir: Path, resume_step: int | None) -> None:
        """Open `RUN_DIR/metrics.jsonl` for appending (a resumed run continues the same file)."""
        self.path = run_dir / "metrics.jsonl"
        with writing(self.path):
            run_dir.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and self.path.is_file():
                trim_rows(self.path, resume_step)
            self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float], **extra: Any) -> None:
        """Append one JSON row and echo it as a line."""
        row = {"step": step, "time": round(time.time(), 3), **extra, **metrics}
        if self._file is not None:
            with writing(self.path):
                self._file.write(json.dumps(row) + "\n")
                self._file.flush()
        if self.echo is not None:
            shown = " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
            where = f"{step}/{self.total_steps}" if self.total_steps else f"{step}"
            self.echo(f"[step {where}] {shown}")

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            f, self._file = self._file, None
            with writing(self.path):
                f.close()


class TensorBoardLogger(Logger):
    """Scalars to TensorBoard event files in `RUN_DIR/tb`, and the hyperparameters to its HParams tab."""

    def __init__(self) -> None:
        """Nothing opens before the run starts."""
        self._tb: Any = None

    def open(self, run_dir: Path, resume_step: int | None) -> None:
        """Open a writer on `RUN_DIR/tb`; a resumed run hides events logged after its step."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            why = "logger=tensorboard needs the tensorboard package: pip install tensorboard"
            raise ConfigError(why) from None
        _quiet_tensorboard_threads()
        self.tb_dir = run_dir / "tb"
        purge = None if resume_step is None else resume_step + 1
        with writing(self.tb_dir):
            self._tb = SummaryWriter(log_dir=str(self.tb_dir), purge_step=purge)

    def log(self, step: int, metrics: dict[str, float], **extra: Any) -> None:
        """One scalar per metric."""
        if self._tb is None:
            return
        with writing(self.tb_dir):
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)

    def log_hparams(self, params: dict[str, Any]) -> None:
        """The configuration as HParams (scalars and strings), in this run's own event file."""
        from torch.utils.tensorboard.summary import hparams

        if self._tb is None:
            return
        flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in params.items()}
        with writing(self.tb_dir):
            for summary in hparams(flat, {}):
                self._tb.file_writer.add_summary(summary)

    def close(self) -> None:
        """Flush and close the writer."""
        if self._tb is not None:
            tb, self._tb = self._tb, None
            with writing(self.tb_dir):
                tb.close()


class CSVLogger(Logger):
    """Each row to `RUN_DIR/metrics.csv`: `step`, `epoch`, then one column per metric key in order of first
    appearance (a row leaves the others empty). A key seen for the first time rewrites the file with the
    wider header; a resumed run first drops the rows logged after its step."""

    def __init__(self) -> None:
        """Nothing opens before the run starts."""
        self._file: Any = None
        self.columns: list[str] = []

    def open(self, run_dir: Path, resume_step: int | None) -> None:
        """Open `RUN_DIR/metrics.csv` for appending (a run in the same directory continues the file), first
        rewritten without the rows a resumed run logs again and without a killed run's torn last row (the
        next row would extend it)."""
        self.path = run_dir / "metrics.csv"
        with writing(self.path):
            run_dir.mkdir(parents=True, exist_ok=True)
            rows = self._read() if self.path.is_file() else []
            if resume_step is not None:
                rows = [r for r in rows if _csv_step(r) <= resume_step]
            self._rewrite(rows)

    def log(self, step: int, metrics: dict[str, float], **extra: Any) -> None:
        """Append one row; a new key first rewrites the file with the wider header."""
        row = {"step": step, **extra, **metrics}
        with writing(self.path):
            new = [k for k in row if k not in self.columns]
            if new:
                self._file.close()
                rows = self._read()
                self.columns += new
                self._rewrite(rows)
            csv.DictWriter(self._file, self.columns, lineterminator="\n").writerow(row)
            self._file.flush()

    def _read(self) -> list[dict[str, str]]:
        """The file's rows (the header becomes `columns`), without a torn last line."""
        text = self.path.read_text(encoding="utf-8")
        if text and not text.endswith("\n"):
            text = text[: text.rfind("\n") + 1]
        reader = csv.DictReader(io.StringIO(text))
        rows = list(reader)
        self.columns = list(reader.fieldnames or [])
        return rows

    def _rewrite(self, rows: list[dict[str, str]]) -> None:
        """Replace the file (atomically) by the header and `rows`, then keep it open for appending."""
        buf = io.StringIO()
        if self.columns:
            writer = csv.DictWriter(buf, self.columns, lineterminator="\n", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        write_text_atomic(self.path, buf.getvalue())
        self._file = self.path.open("a", encoding="utf-8", newline="")

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            f, self._file = self._file, None
            with writing(self.path):
                f.close()


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


def trim_rows(path: Path, last_step: int) -> None:
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


def _csv_step(row: dict[str, str]) -> float:
    try:
        return float(row.get("step") or 0)
    except ValueError:
        return 0.0  # not a number: kept, as metrics.jsonl keeps a line it cannot read


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
