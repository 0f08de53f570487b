"""Resumable batch samplers: an epoch's order depends only on (seed, epoch), so runs restart mid-epoch."""

from __future__ import annotations

import abc
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableBatchSampler(Sampler[list[int]], abc.ABC):
    """A batch sampler whose epoch order is a pure function of (seed, epoch) and that can skip ahead."""

    def __init__(self, seed: int) -> None:
        """Start at epoch 0, batch 0."""
        self.seed = seed
        self.epoch = 0
        self.start = 0

    @abc.abstractmethod
    def batches(self, epoch: int) -> list[list[int]]:
        """All batches of `epoch`, in order."""

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch and how many of its batches were already consumed."""
        self.epoch, self.start = epoch, start

    def generator(self, epoch: int) -> torch.Generator:
        """The generator that orders `epoch`: seeded from (seed, epoch), never from global RNG."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches(self.epoch)[self.start :]

    def __len__(self) -> int:
        return len(self.batches(self.epoch)) - self.start


class ShuffledBatchSampler(ResumableBatchSampler):
    """Plain shuffled (or sequential) fixed-size batches."""

    def __init__(self, n: int, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool = False) -> None:
        """Batch `n` indices `batch_size` at a time."""
        super().__init__(seed)
        self.n, self.batch_size, self.shuffle, self.drop_last = n, batch_size, shuffle, drop_last
        self._cache: tuple[int, list[list[int]]] | None = None

    def batches(self, epoch: int) -> list[list[int]]:
        """Batches of a seeded permutation (or of 0..n-1 when not shuffling)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        order = (
            torch.randperm(self.n, generator=self.generator(epoch)) if self.shuffle else torch.arange(self.n)
        )
        idx = order.tolist()
        out = [idx[i : i + self.batch_size] for i in range(0, self.n, self.batch_size)]
        if self.drop_last and out and len(out[-1]) < self.batch_size:
            out.pop()
        self._cache = (epoch, out)
        return out
