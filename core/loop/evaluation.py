"""Evaluation on a task's held-out split: the batches and the pass the training loop validates with, which
`recipes.eval` runs again on a finished run (one code path, so the same weights give the same numbers), and
the run's best by its monitored metric (`track_best`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from core.data.loaders import on_device, task_loader
from core.data.samplers import LimitedBatchSampler, ResumableBatchSampler
from core.device import DevicePlan
from core.errors import ConfigError
from core.loop.callbacks import improved
from core.loop.task import Task

if TYPE_CHECKING:
    from core.loop.checkpointer import TrainState
    from core.loop.trainer import TrainerConfig

#: what runs between the loader and the model: (model, batch as loaded) -> batch as the model takes it
Prepare = Callable[[nn.Module, Any], Any]


def eval_sampler(task: Task, ds: Dataset, cfg: TrainerConfig, seed: int) -> ResumableBatchSampler:
    """The task's evaluation batches of `ds`: in order, `trainer.eval_batch_size` at a time (0: twice
    `batch_size`, since evaluation keeps no activations for backward), cut to the debug limits
    (`limit_val_batches`, `overfit_batches`)."""
    sampler = task.batch_sampler(ds, cfg.eval_batch_size or 2 * cfg.batch_size, train=False, seed=seed)
    limit = cfg.limit_val_batches or cfg.overfit_batches
    return LimitedBatchSampler(sampler, limit) if limit else sampler


def eval_loader(task: Task, ds: Dataset, cfg: TrainerConfig, plan: DevicePlan, seed: int) -> DataLoader:
    """A DataLoader of `ds` in `eval_sampler`'s batches."""
    return task_loader(task, ds, eval_sampler(task, ds, cfg, seed), plan, workers=cfg.num_workers, seed=seed)


def evaluate(
    task: Task, model: nn.Module, loader: DataLoader, plan: DevicePlan, prepare: Prepare | None = None
) -> dict[str, float]:
    """The task's metrics over `loader` (`Task.evaluate`), in eval mode, without gradients, under the plan's
    autocast; keys come back prefixed with `val/`. `prepare` (default: to the device, then `Task.on_device`)
    readies each batch; the model's train/eval mode is restored afterwards."""
    ready = prepare or (lambda m, b: on_device(task, m, b, plan))
    was_training = model.training
    model.eval()

    def batches() -> Iterator[Any]:
        for b in loader:
            yield ready(model, b)

    try:
        with torch.no_grad(), plan.autocast():
            out = task.evaluate(model, batches())
    finally:
        model.train(was_training)
    return {f"val/{k}": float(v) for k, v in out.items()}


def track_best(state: TrainState, metrics: dict[str, float], monitor: str, maximize: bool) -> None:
    """Record an evaluation's `metrics` in `state`, with the best `monitor` value so far (`best/<monitor>`
    added to `metrics`); a ConfigError when the evaluation has no `monitor`."""
    if monitor not in metrics:
        raise ConfigError(
            f"trainer.monitor={monitor} is not among this task's metrics ({', '.join(sorted(metrics))}); "
            "set trainer.monitor to one of them",
            key="trainer.monitor",
            value=monitor,
            valid=sorted(metrics),
        )
    if improved(metrics[monitor], state.best, maximize):
        state.best, state.best_step = metrics[monitor], state.step
    if state.best is not None:
        metrics[f"best/{monitor}"] = state.best
    state.last_eval = metrics
