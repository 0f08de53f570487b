"""Resumable batch samplers: an epoch's order depends only on (seed, epoch), so runs restart mid-epoch."""

from __future__ import annotations

import abc
import bisect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from core.errors import ConfigError, DataError
from core.rng import derive_seed


class ResumableBatchSampler(Sampler[list[int]], abc.ABC):
    """A batch sampler whose epoch order is a pure function of (seed, epoch) and that can skip ahead."""

    def __init__(self, seed: int) -> None:
        """Start at epoch 0, batch 0."""
        self.seed = seed
        self.epoch = 0
        self.start = 0
        #: top up each short last batch with examples from the start of the same order, so every batch has
        #: the full size (a compiled model then sees one batch size; no example is dropped)
        self.fill_last = False
        self._cache: tuple[int, list[list[int]]] | None = None

    @abc.abstractmethod
    def batches(self, epoch: int) -> list[list[int]]:
        """All batches of `epoch`, in order."""

    def set_fill_last(self, on: bool) -> None:
        """Turn `fill_last` on or off; the batch count is unchanged, so step counts and resume points hold."""
        if on != self.fill_last:
            self.fill_last, self._cache = on, None

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch and how many of its batches were already consumed."""
        self.epoch, self.start = epoch, start

    def generator(self, epoch: int) -> torch.Generator:
        """The generator that orders `epoch`: seeded from (seed, epoch), never from global RNG."""
        return torch.Generator().manual_seed(derive_seed(self.seed, "order", epoch))

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches(self.epoch)[self.start :]

    def __len__(self) -> int:
        return len(self.batches(self.epoch)) - self.start


class LimitedBatchSampler(ResumableBatchSampler):
    """The first `limit` batches of each epoch of another sampler; with `repeat_to`, epoch 0's first
    `limit` batches cycled to `repeat_to` batches, every epoch (a debug run that overfits a fixed few)."""

    def __init__(self, inner: ResumableBatchSampler, limit: int, *, repeat_to: int = 0) -> None:
        """Wrap `inner`, which keeps its own order, bucketing and padding."""
        super().__init__(inner.seed)
        self.inner, self.limit, self.repeat_to = inner, limit, repeat_to

    def batches(self, epoch: int) -> list[list[int]]:
        """`inner`'s batches of `epoch` cut to `limit` (or epoch 0's, cycled to `repeat_to`)."""
        if not self.repeat_to:
            return self.inner.batches(epoch)[: self.limit]
        fixed = self.inner.batches(0)[: self.limit]
        return [fixed[i % len(fixed)] for i in range(self.repeat_to)] if fixed else []

    def set_fill_last(self, on: bool) -> None:
        """Forwarded: the inner sampler builds the batches."""
        super().set_fill_last(on)
        self.inner.set_fill_last(on)

    def __getattr__(self, name: str) -> object:
        # what a task's sampler adds (a bucket sampler's `pad_to_bucket`) stays reachable through the wrapper
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class ShardWindowBatchSampler(ResumableBatchSampler):
    """Batches of samples stored in shards (`core.data.sample_shards`), drawn a window of shards at a time.

    Each epoch the shards are shuffled (a function of (seed, epoch)) and taken `window` at a time; a
    window's samples are batched by a sampler `make(indices, seed)` builds for them (shuffled batches,
    duration buckets), seeded from (seed, epoch, window). An epoch so reads each shard within one window's
    span of batches, and a DataLoader worker keeps at most a window's shards open, instead of seeking across
    every shard of the set; the order stays a pure function of (seed, epoch), so resume, ranks and workers
    see what `ResumableBatchSampler` promises. Without shuffling the windows go in shard order.
    """

    def __init__(
        self,
        shard_of: Sequence[int],
        make: Callable[[list[int], int], ResumableBatchSampler],
        *,
        window: int,
        shuffle: bool,
        seed: int,
        whole: ResumableBatchSampler | None = None,
    ) -> None:
        """`shard_of[i]`: the shard sample i lies in; `whole` (a sampler of the whole set) answers what the
        windows' samplers share with it (a bucket sampler's `pad_to_bucket`)."""
        super().__init__(seed)
        if window < 1:
            raise ConfigError(f"window={window} must be >= 1", key="data.window_shards", value=str(window))
        self.make, self.window, self.shuffle, self.whole = make, window, shuffle, whole
        by_shard: dict[int, list[int]] = {}
        for i, k in enumerate(shard_of):
            by_shard.setdefault(int(k), []).append(i)
        self.shards = [by_shard[k] for k in sorted(by_shard)]

    def batches(self, epoch: int) -> list[list[int]]:
        """The windows' batches in window order, each window's indices mapped back to the whole set's."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        n = len(self.shards)
        order = torch.randperm(n, generator=self.generator(epoch)).tolist() if self.shuffle else range(n)
        order = list(order)
        out: list[list[int]] = []
        for w in range(0, n, self.window):
            idx = [i for k in order[w : w + self.window] for i in self.shards[k]]
            inner = self.make(idx, derive_seed(self.seed, "window", epoch, w))
            inner.set_fill_last(self.fill_last)
            out += [[idx[j] for j in b] for b in inner.batches(0)]
        self._cache = (epoch, out)
        return out

    def __getattr__(self, name: str) -> object:
        if name == "whole" or self.__dict__.get("whole") is None:
            raise AttributeError(name)
        return getattr(self.whole, name)


class ShuffledBatchSampler(ResumableBatchSampler):
    """Plain shuffled (or sequential) fixed-size batches."""

    def __init__(self, n: int, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool = False) -> None:
        """Batch `n` indices `batch_size` at a time."""
        super().__init__(seed)
        self.n, self.batch_size, self.shuffle, self.drop_last = n, batch_size, shuffle, drop_last

    def batches(self, epoch: int) -> list[list[int]]:
        """Batches of a seeded permutation (or of 0..n-1 when not shuffling)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        order = (
            torch.randperm(self.n, generator=self.generator(epoch)) if self.shuffle else torch.arange(self.n)
        )
        idx = order.tolist()
        out = _chunks(idx, self.batch_size, drop_last=self.drop_last, fill_last=self.fill_last)
        self._cache = (epoch, out)
        return out


class PermutedBatchSampler(ShuffledBatchSampler):
    """Shuffled fixed-size batches whose epoch order is a keyed bijection of [0, n), computed batch by batch
    when read: a 4-round Feistel network on the smallest even power of two >= n, cycle-walked back into
    range, its round keys drawn from (seed, epoch). Nothing is held per item, so a corpus of 10^9 token
    windows costs no more memory than one of 10^3 (ShuffledBatchSampler's list of Python ints takes ~40
    bytes an item, on every rank); the order is a different shuffle than randperm's."""

    def batches(self, epoch: int) -> LazyBatches:  # type: ignore[override]
        """The epoch's batches, as a sequence that computes each one when it is read."""
        if not self.shuffle:
            return LazyBatches(
                lambda p: p, self.n, self.batch_size, drop_last=self.drop_last, fill_last=False
            )
        keys = torch.randint(0, 2**31, (4,), generator=self.generator(epoch)).tolist()
        bits = max(2, (self.n - 1).bit_length())
        half = (bits + 1) // 2

        def order(p: torch.Tensor) -> torch.Tensor:
            out = _feistel(p, keys, half)
            while bool((far := out >= self.n).any()):  # the domain is < 4n: a few walks at most
                out[far] = _feistel(out[far], keys, half)
            return out

        return LazyBatches(order, self.n, self.batch_size, drop_last=self.drop_last, fill_last=self.fill_last)


def _feistel(p: torch.Tensor, keys: list[int], half: int) -> torch.Tensor:
    """A bijection of [0, 4^half) (int64 `p`), one round per key; the round function is a 32-bit
    multiply-xorshift hash whose products stay below 2^63."""
    mask = (1 << half) - 1
    left, right = p >> half, p & mask
    for key in keys:
        x = (right * 0x5BD1E995 + key) & 0xFFFFFFFF
        x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
        left, right = right, left ^ ((x ^ (x >> 12)) & mask)
    return (left << half) | right


class LazyBatches(Sequence[list[int]]):
    """`_chunks` of an epoch order given as a function of positions (`order(positions) -> items`), each
    batch's list made only when it is read; a slice is another such view."""

    def __init__(
        self,
        order: Callable[[torch.Tensor], torch.Tensor],
        n: int,
        size: int,
        *,
        drop_last: bool,
        fill_last: bool,
        rows: range | None = None,
    ) -> None:
        """Batches of `size` over positions 0..n-1; `rows`: which of them this view holds (all by default)."""
        self.order, self.n, self.size, self.drop_last, self.fill_last = order, n, size, drop_last, fill_last
        count = n // size + (1 if n % size and not drop_last else 0)
        self.rows = range(count) if rows is None else rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return LazyBatches(
                self.order,
                self.n,
                self.size,
                drop_last=self.drop_last,
                fill_last=self.fill_last,
                rows=self.rows[i],
            )
        b = self.rows[i]
        positions = torch.arange(b * self.size, min((b + 1) * self.size, self.n), dtype=torch.int64)
        if self.fill_last and len(positions) < self.size:  # topped up from the order's start, as _chunks
            positions = torch.arange(b * self.size, (b + 1) * self.size, dtype=torch.int64) % self.n
        return self.order(positions).tolist()


class RepeatedAugmentationBatchSampler(ResumableBatchSampler):
    """Repeated augmentation (Hoffer et al. 2020; DeiT, torchvision's `--ra-sampler`): each batch holds
    `batch_size / reps` images of a seeded permutation, `reps` times over, so the batch carries `reps`
    differently augmented copies of each (the loop seeds each copy's augmentation apart). An epoch is still
    about `n` samples, so it sees about n / reps distinct images; the next epochs' permutations see the rest.

    A batch is its distinct images in order, repeated: [a, b, c, a, b, c, ...]. The loop gives each
    data-parallel rank a contiguous share of a batch, so with `reps` ranks every rank gets one copy of each
    image, as torchvision's sampler spreads them."""

    def __init__(self, n: int, batch_size: int, reps: int, *, seed: int) -> None:
        """Batches of `batch_size` from `n` indices, each distinct index `reps` times in its batch."""
        super().__init__(seed)
        if reps < 1:
            raise ConfigError(f"repeated augmentation reps={reps} must be >= 1 (1: off)")
        self.n, self.batch_size, self.reps = n, batch_size, reps

    def batches(self, epoch: int) -> list[list[int]]:
        """`ceil(n / batch_size)` batches of `ceil(batch_size / reps)` fresh indices each, repeated."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        distinct = -(-self.batch_size // self.reps)
        order = torch.randperm(self.n, generator=self.generator(epoch)).tolist()
        count = -(-self.n // self.batch_size)
        # the epoch's distinct indices, cycling through the permutation only when n < count x distinct
        # (a batch larger than n / reps), so no index repeats across the epoch's batches otherwise
        picks = (order * -(-count * distinct // max(1, self.n)))[: count * distinct]
        out = [
            (picks[b * distinct : (b + 1) * distinct] * self.reps)[: self.batch_size] for b in range(count)
        ]
        self._cache = (epoch, out)
        return out


class LengthBucketBatchSampler(ResumableBatchSampler):
    """Batches of similar-length examples, each padded to one of a few bucket boundaries.

    Boundaries sit at length quantiles rounded up to `multiple`, so an epoch sees at most `num_buckets`
    padded lengths however many raw lengths there are: with dynamic-dim marks this bounds compiled-graph
    recompiles, and similar lengths waste little padding. Pad each batch to `padded_length(max length)`.

    With `max_padded` (Lhotse's and NeMo's batching by total duration), a bucket's shuffled examples fill
    each batch while its count x its longest length stays within `max_padded` (batch_size still caps the
    count): batch sizes vary, and an example longer than the budget makes a batch of its own.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        num_buckets: int = 8,
        multiple: int = 8,
        max_tokens: int | None = None,
        drop_last: bool = False,
        boundaries: Sequence[int] | None = None,
        max_padded: int | None = None,
    ) -> None:
        """Bucket `lengths[i]` (example i's length); `max_tokens` caps batch_size x padded length,
        `max_padded` each batch's count x its longest length."""
        super().__init__(seed)
        sizes = {"batch_size": batch_size, "num_buckets": num_buckets, "multiple": multiple}
        if min(sizes.values()) < 1:
            bad = next(k for k, v in sizes.items() if v < 1)
            raise ConfigError(
                f"batch_size={batch_size}, num_buckets={num_buckets}, multiple={multiple} must all be >= 1",
                key=bad,
                value=str(sizes[bad]),
                valid=(">= 1",),
            )
        self.lengths = [int(n) for n in lengths]
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.max_tokens, self.multiple = max_tokens, multiple
        if max_padded is not None and max_padded < 1:
            raise ConfigError(f"max_padded={max_padded} must be >= 1")
        self.max_padded = max_padded
        if boundaries is None:
            boundaries = self._quantile_boundaries(num_buckets)
        self.boundaries = sorted({int(b) for b in boundaries})
        if self.lengths and max(self.lengths) > self.boundaries[-1]:
            raise DataError(
                f"longest example ({max(self.lengths)}) exceeds the last bucket boundary "
                f"({self.boundaries[-1]}); pass boundaries that reach it",
                key="lengths",
                value=str(max(self.lengths)),
                valid=(f"<= {self.boundaries[-1]}",),
            )

    def _quantile_boundaries(self, num_buckets: int) -> list[int]:
        if not self.lengths:
            return [self.multiple]
        ordered = sorted(self.lengths)
        qs = [
            ordered[min(len(ordered) - 1, (len(ordered) * (k + 1)) // num_buckets - 1)]
            for k in range(num_buckets)
        ]
        qs[-1] = ordered[-1]
        return [max(self.multiple, -(-q // self.multiple) * self.multiple) for q in qs]

    def padded_length(self, length: int) -> int:
        """The bucket boundary a batch whose longest example has `length` is padded to."""
        i = bisect.bisect_left(self.boundaries, length)
        if i == len(self.boundaries):
            raise DataError(
                f"length {length} exceeds the last bucket boundary ({self.boundaries[-1]})",
                key="length",
                value=str(length),
                valid=(f"<= {self.boundaries[-1]}",),
            )
        return self.boundaries[i]

    def pad_to_bucket(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """`x` zero-padded along `dim` to the bucket boundary at or above its size (as is past the last one).

        A compiled model then sees at most `num_buckets` sizes of that dim, which bounds recompiles where
        dynamic-dim marks cannot (Inductor specializes convolution backward on the input's strides).
        """
        n = x.shape[dim]
        i = bisect.bisect_left(self.boundaries, n)
        if i == len(self.boundaries) or self.boundaries[i] == n:
            return x
        pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, self.boundaries[i] - n]
        return torch.nn.functional.pad(x, pad)

    def batches(self, epoch: int) -> list[list[int]]:
        """Seeded shuffles within each bucket, chunked into batches, then a seeded shuffle of the batches."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        g = self.generator(epoch)
        buckets: dict[int, list[int]] = {b: [] for b in self.boundaries}
        for i, n in enumerate(self.lengths):
            buckets[self.padded_length(n)].append(i)
        out: list[list[int]] = []
        for bound, idx in buckets.items():
            if self.shuffle:
                idx = [idx[j] for j in torch.randperm(len(idx), generator=g).tolist()]
            if self.max_padded is not None:
                out += self._fill(idx)
                continue
            size = self.batch_size
            if self.max_tokens is not None:
                size = max(1, min(size, self.max_tokens // bound))
            out += _chunks(idx, size, drop_last=self.drop_last, fill_last=self.fill_last)
        if self.shuffle:
            out = [out[j] for j in torch.randperm(len(out), generator=g).tolist()]
        self._cache = (epoch, out)
        return out

    def _fill(self, idx: list[int]) -> list[list[int]]:
        """`idx` in order, cut where one more example would take count x longest length past `max_padded`
        or the count past batch_size. Variable sizes: `fill_last` (one batch size for a compiled model) does
        not apply, and `drop_last` drops nothing."""
        assert self.max_padded is not None
        out: list[list[int]] = []
        batch: list[int] = []
        longest = 0
        for i in idx:
            n = self.lengths[i]
            if batch and (
                len(batch) == self.batch_size or (len(batch) + 1) * max(longest, n) > self.max_padded
            ):
                out.append(batch)
                batch, longest = [], 0
            batch.append(i)
            longest = max(longest, n)
        return out + ([batch] if batch else [])


def _chunks(idx: list[int], size: int, *, drop_last: bool, fill_last: bool) -> list[list[int]]:
    """`idx` in batches of `size`; a short last one is dropped, or topped up cycling from `idx`'s start."""
    out = [idx[i : i + size] for i in range(0, len(idx), size)]
    if out and len(out[-1]) < size:
        if drop_last:
            out.pop()
        elif fill_last:
            need = size - len(out[-1])
            out[-1] = out[-1] + (idx * -(-need // len(idx)))[:need]
    return out
