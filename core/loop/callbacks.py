"""The loop's extension points: `Callback`s the Trainer calls at fixed moments of a run.

The loop's own concerns plug in the same way a user's do: metrics sinks (`core.logging.sinks`), the progress
display, the checkpoint policy (`Checkpoints`: when to save, which to keep, which is best) and early
stopping. Order of the hooks at each optimizer step: `on_step_end` (the logged row, if this step logs) ->
`on_evaluate` -> `on_eval_end` (if the step evaluates) -> `wants_checkpoint` (any callback may ask) ->
`on_checkpoint`; at an epoch's end: `on_evaluate` -> `on_eval_end` -> `on_epoch_end` -> the epoch-end
checkpoint. A callback with state returns it from `state_dict()` (tensors, numbers, strings, lists and
dicts only: checkpoints load with `weights_only=True`), and a resumed run hands it back before
`on_fit_start`.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from core import checkpoint
from core.bounds import Bounds
from core.errors import ConfigError

if TYPE_CHECKING:
    from core.loop.trainer import Trainer


class Callback:
    """Base class: override the hooks you need; each gets the running `Trainer`."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """After set-up (and resume), before the first step."""

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After each optimizer step; `metrics` is the row logged at this step (empty between log steps)."""

    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After an evaluation, before the best is tracked: add metrics of your own to `metrics` (an EMA
        model's `val/ema_*`), which `trainer.monitor` may then name."""

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After each evaluation, with its `val/*` metrics (and `best/<monitor>`)."""

    def on_epoch_end(self, trainer: Trainer) -> None:
        """After an epoch's last step and its evaluation, before its checkpoint."""

    def wants_checkpoint(self, trainer: Trainer, epoch_end: bool) -> bool:
        """Whether a checkpoint should be written now (any callback saying yes writes one)."""
        return False

    def on_checkpoint(self, trainer: Trainer, path: Path) -> None:
        """After a checkpoint is complete on disk (a background write: once it has finished)."""

    def on_fit_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After the last step and checkpoint of a run that finished (not one stopped by an error)."""

    def close(self) -> None:
        """Release files and threads; called once, however the run ends."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue exactly (empty: stateless)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned."""


def call_all(callbacks: list[Callback], name: str, trainer: Trainer, *args: Any) -> None:
    """Call hook `name` of every callback, in order."""
    for cb in callbacks:
        getattr(cb, name)(trainer, *args)


def close_all(callbacks: list[Callback]) -> None:
    """Close every callback, however the run ends; the first failure is raised after all have closed (but
    not over an exception already on its way out)."""
    first: BaseException | None = None
    for cb in callbacks:
        try:
            cb.close()
        except Exception as e:  # noqa: BLE001  (each sink gets its chance to close)
            first = first or e
    if first is not None and sys.exc_info()[0] is None:
        raise first


def named(callbacks: list[Callback]) -> list[tuple[str, Callback]]:
    """Each callback with a stable name for its checkpointed state (class name, numbered if repeated)."""
    seen: dict[str, int] = {}
    out = []
    for cb in callbacks:
        base = type(cb).__name__
        seen[base] = seen.get(base, 0) + 1
        out.append((base if seen[base] == 1 else f"{base}.{seen[base]}", cb))
    return out


def monitor_direction(key: str, mode: str, *, headline: str, headline_max: bool) -> bool:
    """Whether a larger `key` is better: `mode` max|min, or auto (the task's own direction for its headline
    metric, else read from the name); an unknown name under auto is a ConfigError naming the fix."""
    if mode != "auto":
        return mode == "max"
    if key in (headline, "val/ema_" + headline.removeprefix("val/")):  # the EMA model's headline too
        return headline_max
    name = key.rsplit("/", 1)[-1].lower()
    if any(w in name for w in ("loss", "wer", "cer", "perplexity", "ppl", "error")):
        return False
    if any(w in name for w in ("acc", "f1", "precision", "recall", "map", "auc", "bleu")):
        return True
    raise ConfigError(
        f"trainer.monitor={key}: cannot tell whether larger is better; set trainer.monitor_mode=max or min",
        key="trainer.monitor_mode",
        value=mode,
        valid=("max", "min"),
    )


def improved(value: float, best: float | None, maximize: bool, min_delta: float = 0.0) -> bool:
    """`value` beats `best` by more than `min_delta` in the monitored direction (NaN never does)."""
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    return value > best + min_delta if maximize else value < best - min_delta


class Checkpoints(Callback):
    """The loop's checkpoint policy: save every `ckpt_every` steps, at each epoch's end and whenever the
    monitored metric improves (so the best weights are on disk); keep the newest `keep_last` and the best
    `keep_best` by the monitored value each checkpoint's meta records."""

    def __init__(self, *, ckpt_every: int, keep_last: int, keep_best: int) -> None:
        """See `core.loop.trainer.TrainerConfig` for the meaning of each setting."""
        self.ckpt_every, self.keep_last, self.keep_best = ckpt_every, keep_last, keep_best

    def wants_checkpoint(self, trainer: Trainer, epoch_end: bool) -> bool:
        """At an epoch's end, every `ckpt_every` steps, and when this step's evaluation was the best."""
        due = self.ckpt_every > 0 and trainer.state.step % self.ckpt_every == 0
        best_now = self.keep_best > 0 and trainer.state.best_step == trainer.state.step
        return epoch_end or due or best_now

    def on_checkpoint(self, trainer: Trainer, path: Path) -> None:
        """Prune what the policy no longer keeps (rank 0 alone deletes)."""
        if trainer.dist.is_main:
            checkpoint.prune(
                path.parent,
                keep_last=self.keep_last,
                keep_best=self.keep_best,
                maximize=trainer.monitor_max,
            )


@dataclass
class EarlyStopConfig:
    """Stop when the monitored metric (`trainer.monitor`) has not improved for `patience` evaluations."""

    #: evaluations without an improvement before stopping; 0: never stop early
    patience: Annotated[int, Bounds(ge=0)] = 0
    #: an improvement smaller than this does not count
    min_delta: Annotated[float, Bounds(ge=0)] = 0.0


class BenchmarkEvals(Callback):
    """trainer.evals: the task's benchmark function (`Task.benchmarks`) run on the model at evaluations
    `every` steps apart (0: each), its eval/<task>/<metric> metrics added beside val/* before they are
    logged; the model is scored in eval mode and left in the mode it was in. Under several ranks (each a
    whole replica: DDP) rank 0 alone scores while the others wait, and every rank gets its numbers, so
    decisions on them (early stopping, the best checkpoint) agree."""

    def __init__(self, run: Any, every: int) -> None:
        """Call `run(model, plan)` at evaluations whose step is a multiple of `every` (0: every one)."""
        self.run, self.every = run, every

    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Add the benchmark metrics at a due step."""
        if self.every and trainer.state.step % self.every:
            return
        from core.distributed.group import broadcast_object

        scores: dict[str, float] = {}
        if trainer.dist.is_main:
            model = getattr(trainer.model, "module", trainer.model)  # DDP's replica: no collective per call
            was_training = model.training
            try:
                scores = self.run(model.eval(), trainer.plan)
            finally:
                model.train(was_training)
        metrics.update(broadcast_object(scores))  # the other ranks wait here for rank 0's


def benchmark_evals(task: Any, cfg: Any, world_size: int) -> list[Callback]:
    """The BenchmarkEvals of `cfg.evals` (trainer.evals) for `task`, checked before training: none without
    the key; a layout that shards the model over several ranks (FSDP, tensor parallel) is a one-line
    ConfigError (no rank holds a model it could score alone)."""
    if not cfg.evals:
        return []
    if world_size > 1:
        from core.distributed.mesh import mesh_shape

        shape = mesh_shape(
            cfg.parallel, world_size, tp=cfg.tp, dp_shard=cfg.dp_shard, dp_replicate=cfg.dp_replicate
        )
        if shape.dp_shard > 1 or shape.tp > 1:
            raise ConfigError(
                f"trainer.evals scores a whole model on rank 0; trainer.parallel={cfg.parallel} shards it "
                "over the ranks: use trainer.parallel=ddp, or evaluate the run's checkpoints with "
                "recipes.eval harness.tasks=... (which shards the requests over ranks)",
                key="trainer.parallel",
                value=cfg.parallel,
                valid=("ddp", "auto"),
            )
    return [BenchmarkEvals(task.benchmarks(list(cfg.evals), cfg.evals_limit), cfg.evals_every)]


class EarlyStopping(Callback):
    """Asks the loop to stop after `patience` evaluations without an improvement of `min_delta`."""

    def __init__(self, cfg: EarlyStopConfig) -> None:
        """Count from no evaluation seen."""
        self.cfg = cfg
        self.best: float | None = None
        self.bad_evals = 0

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Count an evaluation without improvement; past `patience`, request the stop."""
        value = metrics.get(trainer.monitor)
        if value is None or self.cfg.patience == 0:
            return
        if improved(value, self.best, trainer.monitor_max, self.cfg.min_delta):
            self.best, self.bad_evals = value, 0
            return
        self.bad_evals += 1
        if self.bad_evals >= self.cfg.patience:
            trainer.request_stop(
                f"early stop: {trainer.monitor} has not improved by more than {self.cfg.min_delta} "
                f"for {self.bad_evals} evaluations (best {self.best:.4g})"
            )

    def state_dict(self) -> dict[str, Any]:
        """The best value and the count of evaluations since it."""
        return {"best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the count where the checkpoint left it."""
        self.best, self.bad_evals = state.get("best"), int(state.get("bad_evals", 0))
