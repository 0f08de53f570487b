"""DataLoaders over a task's datasets, and batches moved to the device: one construction for the training
loop's loaders and for the evaluation of a finished run (`core.loop.evaluation`), so both read the same
batches."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from core.data.workers import TrackedSamples
from core.device import DevicePlan
from core.loop.task import Task
from core.rng import derive_seed


def task_loader(
    task: Task,
    samples: Dataset,
    batch_sampler: Sampler[Any],
    plan: DevicePlan,
    *,
    workers: int = -1,
    seed: int = 0,
    epoch: int = 0,
    split: str = "val",
    described: Any = None,
    collate_fn: Any = None,
) -> DataLoader:
    """A DataLoader of `samples` in `batch_sampler`'s batches, collated by the task; `workers` -1 is the
    task's own count or else the device plan's. `described` (default `samples`) names a sample's file when a
    worker dies loading it; `collate_fn` replaces the task's evaluation collate (training's)."""
    if workers < 0:
        workers = plan.num_workers if task.loader_workers is None else task.loader_workers
    if workers > 0:  # a worker that dies is then reported with the sample it was loading
        samples = TrackedSamples(samples, workers, split=split, described=described)
    return DataLoader(
        samples,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn or task.collate_fn(),
        num_workers=workers,
        pin_memory=plan.pin_memory,
        # worker seeds derive from this generator, so they depend on (seed, epoch) only
        generator=torch.Generator().manual_seed(derive_seed(seed, "loader", epoch)),
    )


def to_device(batch: Any, plan: DevicePlan) -> Any:
    """`batch` (a tensor, or dicts, lists and tuples of them) on the plan's device."""
    dev, nb = plan.device, plan.pin_memory
    if isinstance(batch, torch.Tensor):
        return batch.to(dev, non_blocking=nb)
    if isinstance(batch, dict):
        return {k: to_device(v, plan) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, plan) for v in batch)
    return batch


def on_device(task: Task, model: nn.Module, batch: Any, plan: DevicePlan) -> Any:
    """`batch` moved to the device, then through the task's device-side preprocessing (`Task.on_device`)."""
    return task.on_device(model, to_device(batch, plan))
