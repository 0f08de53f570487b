"""A tiny task that exercises every source of randomness the loop must control (used by core tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from core.data.samplers import ResumableBatchSampler
from core.loop.task import StepOutput, Task

IGNORE = -100  # cross_entropy's ignore_index


class NoisyPoints(Dataset):
    """Gaussian blobs; training samples get random jitter, like an augmentation."""

    def __init__(self, n: int, jitter: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.y = torch.arange(n) % 3
        self.x = torch.randn(n, 4, generator=g) + self.y[:, None].float()
        self.jitter = jitter

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + self.jitter * torch.randn(4), self.y[i]


class ToyTask(Task):
    """3-way classification with dropout; `jitter`/`dropout` 0 make it deterministic apart from order."""

    primary_metric = "val/accuracy"
    maximize = True
    loader_workers = 0

    def __init__(self, n: int = 40, jitter: float = 0.1, dropout: float = 0.2) -> None:
        self.n, self.jitter, self.dropout = n, jitter, dropout

    def build_model(self) -> nn.Module:
        torch.manual_seed(1)  # identical init across runs being compared
        return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(self.dropout), nn.Linear(16, 3))

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        return NoisyPoints(self.n, self.jitter), NoisyPoints(12, 0.0)

    def step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> StepOutput:
        x, y = batch
        logits = model(x)
        acc = (logits.argmax(-1) == y).float().mean()
        return StepOutput(F.cross_entropy(logits, y), len(y), {"accuracy": acc})


class FixedBatches(ResumableBatchSampler):
    """Consecutive batches of the given sizes, the same every epoch: unequal micro-batches on purpose."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__(seed=0)
        self.sizes = sizes

    def batches(self, epoch: int) -> list[list[int]]:
        ends = [sum(self.sizes[: k + 1]) for k in range(len(self.sizes))]
        return [list(range(end - n, end)) for n, end in zip(self.sizes, ends, strict=True)]


class MaskedToyTask(ToyTask):
    """The toy task in float64 with training batches of fixed `sizes` and, when `ignore_every` > 0, every
    such example's target ignored (as an LM ignores targets across documents): its loss is a mean over the
    targets kept, so micro-batches hold unequal counts of loss units even where their examples are equal."""

    primary_metric, maximize = "val/loss", False

    def __init__(self, sizes: tuple[int, ...], ignore_every: int = 0) -> None:
        super().__init__(n=sum(sizes), jitter=0.0, dropout=0.0)
        self.sizes, self.ignore_every = sizes, ignore_every

    def build_model(self) -> nn.Module:
        return super().build_model().double()

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        train, val = super().build_datasets()
        for ds in (train, val):
            ds.x = ds.x.double()
        if self.ignore_every:
            # unevenly spread: the ignored targets fall unequally on micro-batches and on ranks' shares
            train.y[:: self.ignore_every] = IGNORE
            train.y[1] = IGNORE
        return train, val

    def batch_sampler(
        self, dataset: Dataset, batch_size: int, *, train: bool, seed: int
    ) -> ResumableBatchSampler:
        return (
            FixedBatches(self.sizes) if train else super().batch_sampler(dataset, 64, train=False, seed=seed)
        )

    def step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> StepOutput:
        x, y = batch
        logits = model(x)
        # sum / count: a share whose targets are all ignored has loss 0 (not an empty mean's NaN)
        kept = (y != IGNORE).sum().clamp(min=1)
        return StepOutput(F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum") / kept, len(y))

    def loss_units(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return int((batch[1] != IGNORE).sum())
