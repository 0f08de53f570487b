"""Text classification's datasets: labelled texts registered by name (the KJV's book groups, your own CSV or
JSONL table), their token-id form, and the padded, length-bucketed batches the task trains on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import torch
from torch.utils.data import Dataset

from core.bounds import Bounds
from core.data.bad_samples import DEFAULT_POLICY, BadSamplePolicy
from core.data.samplers import ResumableBatchSampler
from core.errors import ConfigError, DataError
from core.registry import DATASETS
from text.corpus import BOOK_GROUPS, book_group, in_validation, kjv_verses, read_labelled


@dataclass
class LabelledTexts:
    """Training and validation (text, label index) pairs and the label names."""

    train: list[tuple[str, int]]
    val: list[tuple[str, int]]
    labels: list[str]


@DATASETS.register("kjv_groups")
def kjv_groups(
    *, val_fraction: Annotated[float, Bounds(gt=0, lt=1)] = 0.1, policy: BadSamplePolicy = DEFAULT_POLICY
) -> LabelledTexts:
    """KJV verses labelled with one of 8 book groups (Law .. Revelation), split by a hash of the reference.

    val_fraction: fraction of the verses held out for validation
    policy: accepted like every data section's, with nothing to skip in the checked-in text
    """
    train, val = [], []
    for v in kjv_verses():
        (val if in_validation(v.reference, val_fraction) else train).append(
            (v.text, book_group(v.book_index))
        )
    return LabelledTexts(train, val, [name for name, _ in BOOK_GROUPS])


@DATASETS.register("text_table")
def text_table(
    *,
    train: Annotated[str, Bounds(exists="file")] = "",
    val: Annotated[str, Bounds(exists="file")] = "",
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> LabelledTexts:
    """CSV or JSONL files with `text` and `label` fields; labels are the sorted distinct training labels.

    train: the training file, .csv or .jsonl (required)
    val: the validation file, .csv or .jsonl (required)
    """
    if not train or not val:
        raise ConfigError("data=text_table needs data.train=PATH and data.val=PATH (.csv or .jsonl)")
    tr, va = read_labelled(train, policy), read_labelled(val, policy)
    labels = sorted({lab for _, lab in tr})
    index = {lab: i for i, lab in enumerate(labels)}
    unknown = sorted({lab for _, lab in va} - index.keys())
    if unknown:
        raise DataError(f"{val}: labels {unknown[:5]} never occur in {train}; the model cannot predict them")
    return LabelledTexts([(t, index[lab]) for t, lab in tr], [(t, index[lab]) for t, lab in va], labels)


class EncodedTexts(Dataset):
    """Token id tensors (truncated to `max_len`) with their labels."""

    def __init__(self, ids: list[list[int]], labels: list[int], max_len: int) -> None:
        """Keep at most `max_len` tokens of each text."""
        self.ids = [torch.tensor(x[:max_len], dtype=torch.long) for x in ids]
        self.labels = torch.tensor(labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i], self.labels[i]


def pad_batch(pad_id: int) -> Callable[[list[tuple[torch.Tensor, torch.Tensor]]], dict[str, torch.Tensor]]:
    """Collate to {tokens (B, L) right-padded with `pad_id`, mask (B, L) True on real tokens, labels (B,)}."""

    def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(1, max(len(x) for x, _ in items))  # an empty text still gets one (masked) slot
        tokens = torch.full((len(items), longest), pad_id, dtype=torch.long)
        mask = torch.zeros(len(items), longest, dtype=torch.bool)
        for i, (x, _) in enumerate(items):
            tokens[i, : len(x)] = x
            mask[i, : max(1, len(x))] = True  # an empty text attends to one pad token, not to nothing (NaN)
        return {"tokens": tokens, "mask": mask, "labels": torch.stack([y for _, y in items])}

    return collate


class BucketBatchSampler(ResumableBatchSampler):
    """Shuffled batches of similar lengths: pools of 50 batches are sorted by length, then cut into batches.

    Padding shrinks to a few tokens per row while every epoch's order stays a pure function of (seed, epoch).
    """

    POOL_BATCHES = 50

    def __init__(self, lengths: list[int], batch_size: int, *, shuffle: bool, seed: int) -> None:
        """Batch indices of texts with `lengths`, `batch_size` at a time."""
        super().__init__(seed)
        self.lengths, self.batch_size, self.shuffle = torch.tensor(lengths), batch_size, shuffle
        self._cache: tuple[int, list[list[int]]] | None = None

    def batches(self, epoch: int) -> list[list[int]]:
        """All batches of `epoch` (sorted by length within pools; pool and batch order shuffled)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        n, bs = len(self.lengths), self.batch_size
        if not self.shuffle:  # evaluation: fully sorted, order irrelevant to the result
            order = torch.argsort(self.lengths, stable=True).tolist()
            out = [order[i : i + bs] for i in range(0, n, bs)]
        else:
            g = self.generator(epoch)
            perm = torch.randperm(n, generator=g)
            out = []
            for p in range(0, n, bs * self.POOL_BATCHES):
                pool = perm[p : p + bs * self.POOL_BATCHES]
                pool = pool[torch.argsort(self.lengths[pool], stable=True)].tolist()
                out += [pool[i : i + bs] for i in range(0, len(pool), bs)]
            out = [out[i] for i in torch.randperm(len(out), generator=g).tolist()]
        self._cache = (epoch, out)
        return out
