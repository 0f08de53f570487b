"""Debug aids a run can switch on (`trainer.overfit_batches`, `trainer.profile_steps`,
`trainer.detect_anomaly`; the recipes' `debug=overfit|limit|profile|anomaly` presets set them)."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from core.errors import TrainingError
from core.logging.messages import say
from core.loop.callbacks import Callback

if TYPE_CHECKING:
    from core.loop.trainer import Trainer

#: on a few fixed batches, a model that can learn at all gets its loss below this fraction of the first
#: logged value well within a debug run's steps; one that cannot (labels shuffled, loss or lr wrong) stays
OVERFIT_RATIO = 0.5


class OverfitCheck(Callback):
    """With `trainer.overfit_batches`: the run fails (exit 3) unless its training loss on those fixed
    batches ends below `OVERFIT_RATIO` of where it started."""

    def __init__(self) -> None:
        """No loss seen yet."""
        self.first: float | None = None
        self.last: float | None = None

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Keep the first and latest logged training loss."""
        loss = metrics.get("train/loss")
        if loss is None:
            return
        if self.first is None:
            self.first = loss
        self.last = loss

    def on_fit_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Fail unless the loss fell below `OVERFIT_RATIO` of its start."""
        n = trainer.cfg.overfit_batches
        if self.first is None or self.last is None:
            raise TrainingError(
                "debug overfit: no training loss was logged; set trainer.log_every below trainer.max_steps"
            )
        ok = math.isfinite(self.last) and self.last < OVERFIT_RATIO * self.first
        verdict = "fits them" if ok else "does not fit them"
        say(f"overfit check: loss on {n} fixed batch(es) {self.first:.4g} -> {self.last:.4g}: {verdict}")
        if not ok:
            raise TrainingError(
                f"trainer.overfit_batches={n}: the training loss went from {self.first:.4g} to "
                f"{self.last:.4g}, not below {OVERFIT_RATIO:g}x its start; a model that cannot fit "
                "a few batches has a bug in its labels, loss or inputs, or optim.lr is off",
                key="trainer.overfit_batches",
                value=str(n),
            )

    def state_dict(self) -> dict[str, Any]:
        """The losses seen, so a resumed debug run judges from the same start."""
        return {"first": self.first, "last": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the losses seen."""
        self.first, self.last = state.get("first"), state.get("last")


class Profiler(Callback):
    """`torch.profiler` over `steps` optimizer steps after 2 of warm-up: a Chrome/Perfetto trace
    (`trace.json`) and a table of the ops that took the most time (`top_ops.txt`, also printed); then the
    run stops (a profiling run is not a training run)."""

    def __init__(self, out_dir: Path, steps: int, rows: int = 15, *, write: bool = True) -> None:
        """Write into `out_dir` (`write` false: profile and stop with the others, write nothing: ranks
        other than 0 of a multi-process run, which must stop at the same step)."""
        self.out_dir, self.steps, self.rows, self.write = out_dir, steps, rows, write
        self.prof: Any = None
        self.done = False

    def on_fit_start(self, trainer: Trainer) -> None:
        """Start profiling (CPU, and CUDA where the run is on a GPU)."""
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if trainer.plan.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.cuda, self.trainer = trainer.plan.device.type == "cuda", trainer
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=1, warmup=1, active=self.steps, repeat=1),
            on_trace_ready=self._write,
            record_shapes=True,
        )
        self.prof.start()

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Advance the profiler's schedule by one step."""
        if self.prof is not None and not self.done:
            self.prof.step()

    def _write(self, prof: Any) -> None:
        self.done = True
        self.trainer.request_stop(f"profile done after {self.steps} steps (trainer.profile_steps)")
        if not self.write:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out_dir / "trace.json"))
        key = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=self.rows)
        (self.out_dir / "top_ops.txt").write_text(table + "\n")
        say(
            f"profile of {self.steps} steps: {self.out_dir / 'trace.json'} (open in Perfetto or chrome://tracing)"
        )
        say(table)

    def close(self) -> None:
        """Stop the profiler; a run shorter than the schedule writes nothing and says so."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.stop()
        if not self.done:
            say(f"profile: the run ended before its {self.steps} profiled steps (after 2 warm-up); no trace")


@contextlib.contextmanager
def anomaly_detection(enabled: bool) -> Iterator[None]:
    """`torch.autograd` anomaly detection for the block when `enabled` (the op that made a NaN is named)."""
    if not enabled:
        yield
        return
    with torch.autograd.detect_anomaly(check_nan=True):
        yield


def anomaly_error(error: RuntimeError, step: int, where: tuple[int, int]) -> TrainingError | None:
    """The NaN/inf that `anomaly_detection` traced to an op in a backward (`step`, `where` = its epoch and
    batch) as one line (exit 3), not a traceback; None for another error."""
    if "nan" not in str(error).lower():
        return None
    first = str(error).strip().splitlines()[0]
    op = re.search(r"Function '(\w+)'", first)  # autograd's "Function 'SqrtBackward0' returned nan"
    return TrainingError(
        f"trainer.detect_anomaly: {first} (step {step}, epoch {where[0]}, batch {where[1]}); the op named "
        "produced it: check its inputs, or lower optim.lr",
        key="trainer.detect_anomaly",
        value=op.group(1) if op else first,
    )
