"""Datasets that break a DataLoader worker on purpose (used by tests/core/test_workers.py)."""

from __future__ import annotations

import os
import signal

import torch

from core.data.bad_samples import DEFAULT_POLICY, BadSamplePolicy
from core.registry import DATASETS
from tests.core.toy_task import NoisyPoints
from vision.datasets import DIGITS_AUGMENT, TensorImages, VisionData, digits
from vision.transforms import Augment

#: the sample whose loading kills its worker
KILL_INDEX = 5


class KillerPoints(NoisyPoints):
    """NoisyPoints whose sample KILL_INDEX sends SIGKILL to the process loading it; it knows its "paths"."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == KILL_INDEX:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)

    def describe(self, i: int) -> str:
        """A made-up file name for sample i."""
        return f"points/{i:04d}.pt"


class KillerImages(TensorImages):
    """TensorImages whose sample KILL_INDEX sends SIGKILL to the process loading it."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == KILL_INDEX:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)

    def describe(self, i: int) -> str:
        """A made-up file name for sample i."""
        return f"digits/{i:04d}.png"


@DATASETS.register("killer_digits")
def killer_digits(
    *,
    val_fraction: float = 0.2,
    split_seed: int = 0,
    augment: bool = True,
    augmentation: Augment = DIGITS_AUGMENT,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> VisionData:
    """digits, with a training sample that kills the worker loading it (not in memory: workers load it)."""
    d = digits(
        val_fraction=val_fraction,
        split_seed=split_seed,
        augment=augment,
        augmentation=augmentation,
        policy=policy,
    )
    d.train = KillerImages(d.train.images, d.train.labels, d.train.transform)
    d.in_memory = False
    return d
