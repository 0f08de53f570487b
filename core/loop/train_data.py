"""The training data as the loop reads it: the task's datasets, the training split's resumable batch order
cut to the debug limits, the evaluation loader and the run's length (`build`); each epoch's loader of one
rank's share, every sample seeded (`train_loader`); and one rank's share of a batch, which the set-up's
probes step (`batch_share`).

The data order is the sampler's, given again by the run's seed and the loop position (epoch, batch) a
checkpoint stores, so resuming needs no data state of its own.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

from torch.utils.data import DataLoader, Dataset, default_collate

from core.data.loaders import task_loader
from core.data.samplers import LimitedBatchSampler, ResumableBatchSampler
from core.data.seeded import SeededBatches, SeededCollate, SeededSamples
from core.device import DevicePlan
from core.errors import ConfigError
from core.files import write_failure
from core.loop import evaluation
from core.loop.config import TrainerConfig
from core.loop.task import Task


class TrainData(NamedTuple):
    """What a run trains and evaluates on, and for how many optimizer steps."""

    dataset: Dataset
    sampler: ResumableBatchSampler
    val_loader: DataLoader
    total_steps: int


def build(task: Task, cfg: TrainerConfig, plan: DevicePlan, seed: int, run_dir: Path) -> TrainData:
    """The task's datasets and batches under `cfg` (its debug limits among them); the task's artifacts (e.g.
    its tokenizer) are written into `run_dir` on the way."""
    train_ds, val_ds = task.build_datasets()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        task.save_artifacts(run_dir)
    except OSError as e:  # a full disk: one line naming the file, exit 74, as for any output
        where = Path(e.filename) if e.filename else run_dir
        raise write_failure(where, e, fix="nothing was trained yet") from None
    sampler = task.batch_sampler(train_ds, cfg.batch_size, train=True, seed=seed)
    if cfg.overfit_batches:  # one epoch: the same few batches over and over, `overfit_steps` steps
        repeat, n = cfg.overfit_steps * cfg.grad_accum, cfg.overfit_batches
        sampler = LimitedBatchSampler(sampler, n, repeat_to=repeat)
    elif cfg.limit_train_batches:
        sampler = LimitedBatchSampler(sampler, cfg.limit_train_batches)
    val_loader = evaluation.eval_loader(task, val_ds, cfg, plan, seed)
    steps_per_epoch = math.ceil(len(sampler.batches(0)) / cfg.grad_accum)
    if steps_per_epoch == 0:
        raise ConfigError("the training set is empty; check data= and its paths")
    total_steps = cfg.max_steps if cfg.max_steps > 0 else steps_per_epoch * cfg.max_epochs
    if cfg.overfit_batches:  # a debug run's own length: task configs set max_steps/max_epochs
        total_steps = cfg.overfit_steps
    return TrainData(train_ds, sampler, val_loader, total_steps)


def train_loader(
    task: Task,
    ds: Dataset,
    sampler: ResumableBatchSampler,
    plan: DevicePlan,
    *,
    seed: int,
    epoch: int,
    share: tuple[int, int],
    workers: int,
) -> DataLoader:
    """The training loader of `epoch`: each sample's augmentation seeded, the share (index, count) of a
    batch of one data-parallel rank."""
    return task_loader(
        task,
        SeededSamples(ds),
        SeededBatches(sampler, seed, epoch, share),
        plan,
        workers=workers,
        seed=seed,
        epoch=epoch,
        split="train",
        described=ds,
        # the task's training collate (MixUp/CutMix draws), seeded from the batch's samples
        collate_fn=SeededCollate(task.train_collate_fn()),
    )


def batch_share(task: Task, ds: Dataset, sampler: ResumableBatchSampler, ranks: int, index: int = 0) -> Any:
    """One rank's contiguous share among `ranks` of epoch 0's training batch `index` (cycled: an epoch may
    have fewer), collated."""
    batches = sampler.batches(0)
    indices = batches[index % len(batches)]
    indices = indices[: max(1, len(indices) // ranks)]
    collate = task.train_collate_fn() or task.collate_fn() or default_collate
    return collate([ds[i] for i in indices])
