"""Per-sample seeds for the training loader: a sample's random transforms, and a batch's collate draws
(MixUp/CutMix), depend on (run seed, epoch, sample index) alone. So any number of DataLoader workers, any
data-parallel size and a resumed run's loader all produce the same batches as one uninterrupted process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from core.data.samplers import ResumableBatchSampler
from core.rng import derive_seed


class SeededSamples(Dataset):
    """Runs each sample's random transforms under a seed fixed by (run seed, epoch, index)."""

    def __init__(self, ds: Dataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, Any]:
        """(the sample's seed, the sample); `SeededCollate` takes the seeds off again."""
        idx, seed = key
        # only the CPU generator: augmentation runs on CPU, and CUDA RNG (dropout) must stay untouched
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            return seed, self.ds[idx]


class SeededCollate:
    """Runs a training collate (MixUp draws its mixing there) under a seed fixed by its batch's first sample
    seed, so a batch's draws depend on (run seed, epoch, its samples) alone: not on which worker collates it
    nor on where a resumed run's loader started."""

    def __init__(self, collate: Callable[[list[Any]], Any] | None) -> None:
        self.collate = collate or default_collate

    def __call__(self, items: list[tuple[int, Any]]) -> Any:
        seeds, samples = zip(*items, strict=True)
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(derive_seed(seeds[0], "collate"))
            return self.collate(list(samples))


class SeededBatches:
    """Pairs each index from a resumable batch sampler with its per-sample seed; with several data-parallel
    ranks, each takes its contiguous share of every global batch, so the global batches (and a sample's
    seed) are those of a one-process run."""

    def __init__(
        self, sampler: ResumableBatchSampler, seed: int, epoch: int, share: tuple[int, int] = (0, 1)
    ) -> None:
        self.sampler, self.seed, self.epoch, (self.rank, self.ranks) = sampler, seed, epoch, share

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for batch in self.sampler:
            # a sample's seed is (run seed, epoch, index); a second copy of an index in the same batch
            # (repeated augmentation) adds its copy number, so copies are augmented apart
            copies: dict[int, int] = {}
            seeded = []
            for i in batch:
                k = copies[i] = copies.get(i, -1) + 1
                seeded.append((i, derive_seed(self.seed, "sample", self.epoch, i, *((k,) if k else ()))))
            if self.ranks > 1 and len(seeded) % self.ranks:
                # a batch that does not split evenly (a length bucket's token budget) is topped up from its
                # own start, seeds included: each rank gets an equal share and no sample is dropped
                need = -len(seeded) % self.ranks
                seeded = seeded + (seeded * need)[:need]
            k = len(seeded) // self.ranks
            yield seeded[self.rank * k : (self.rank + 1) * k] if self.ranks > 1 else seeded

    def __len__(self) -> int:
        return len(self.sampler)


def _quiet(message: str) -> None:
    """`say` for ranks other than 0."""
