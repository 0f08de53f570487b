"""A tiny task that exercises every source of randomness the loop must control (used by core tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from core.task import StepOutput, Task


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
