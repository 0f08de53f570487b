"""The shapes a compiled model sees: dynamic-dim marks on batches, and a task's `ShapeHints` applied."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from core.compile import torch_internals

if TYPE_CHECKING:
    from core.loop.task import ShapeHints


def _tensors(batch: Any, key: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        yield key, batch
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from _tensors(v, str(k))
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v, key)
    elif hasattr(batch, "__dataclass_fields__"):
        for k in batch.__dataclass_fields__:
            yield from _tensors(getattr(batch, k), k)


def apply_shape_hints(batch: Any, hints: ShapeHints, sampler: object, *, training: bool) -> Any:
    """A compiled model's batch shaped per the task's `hints`: bucketed dims padded up to `sampler`'s
    boundaries (a `LengthBucketBatchSampler`; other samplers have none), static dims marked, and in
    evaluation the dims whose last batches are short marked dynamic. Returns the (new) batch."""
    if not isinstance(batch, dict):
        return batch
    pad = getattr(sampler, "pad_to_bucket", None)
    if pad is not None and hints.bucket_pad:
        batch = {k: pad(v, hints.bucket_pad[k]) if k in hints.bucket_pad else v for k, v in batch.items()}
    if not training and hints.eval_dynamic:
        mark_dynamic_batch(batch, hints.eval_dynamic)
    for key, dims in hints.static.items():
        for d in dims:
            if key in batch:
                torch_internals.mark_static(batch[key], d)
    return batch


def mark_dynamic_batch(batch: Any, dims: Sequence[int] | Mapping[str, Sequence[int]] = (0,)) -> Any:
    """Mark the varying dims (batch, time) of every tensor in `batch` dynamic so dynamo compiles them
    symbolically from the first call instead of recompiling per shape; returns `batch`.

    `dims` applies to every tensor that has them, or maps a dict/dataclass key to its dims. Call it after
    the batch is on its device (`.to()` makes new tensors without the marks). The marks are hints, not
    constraints: a model that branches on a size still works, it just recompiles (and that is counted).
    """
    mark = torch_internals.mark_dynamic
    marked_sizes.clear()
    for key, tensor in _tensors(batch):
        wanted: Iterable[int] = dims.get(key, ()) if isinstance(dims, Mapping) else dims
        for d in wanted:
            if -tensor.dim() <= d < tensor.dim():
                mark(tensor, d % tensor.dim())
                if tensor.shape[d] >= 2:  # dynamo specialises sizes 0 and 1 whatever the marks say
                    marked_sizes.add(int(tensor.shape[d]))
    return batch


#: sizes of the dims the latest `mark_dynamic_batch` marked; regionally compiled blocks mark the dims of
#: their inputs that have these sizes, because activations (e.g. the embedding output) do not inherit marks
#: and dynamo would otherwise compile each block statically first and recompile (twice, for view and
#: non-view inputs) on every newly varying dim
marked_sizes: set[int] = set()


def mark_matching_dims(inputs: Any) -> None:
    """Mark dynamic every dim of `inputs` whose size the latest `mark_dynamic_batch` marked."""
    for _key, tensor in _tensors(inputs):
        for d, size in enumerate(tensor.shape):
            if size in marked_sizes:
                torch_internals.mark_dynamic(tensor, d)


def length_bucket(n: int, limit: int) -> int:
    """The length bucket `n` rounds up to: the next of 16, 24, 32, 48, 64, 96, ... (two a doubling, so past
    16 under a third of a row is padding), never above `limit` (nor below `n`)."""
    size = 16
    while size < n:
        # 2^k -> 3 * 2^(k-1) -> 2^(k+1): the two steps alternate
        size = size * 3 // 2 if size & (size - 1) == 0 else size // 3 * 4
    return max(n, min(size, limit))
