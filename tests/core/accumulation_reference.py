"""The check every task's accumulation test makes: micro-batches weighted as the loop weighs them
(`Task.loss_units` -> `core.loop.accumulation.group_weights`) give the gradient of one batch of their
examples."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from core.loop.accumulation import group_weights
from core.loop.task import Task

#: the batch as loaded -> as the model takes it (the task's on_device, a cast to float64, ...)
Prepare = Callable[[nn.Module, Any], Any]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def accumulated_grads(
    task: Task, model: nn.Module, batches: Sequence[Any], prepare: Prepare
) -> dict[str, torch.Tensor]:
    """The gradient the loop accumulates over `batches` (one group, one process)."""
    weights = group_weights([task.loss_units(b) for b in batches], torch.device("cpu"))
    for batch, weight in zip(batches, weights, strict=True):
        (task.step(model, prepare(model, batch)).loss * weight).backward()
    return _grads(model)


def one_batch_grads(task: Task, model: nn.Module, batch: Any, prepare: Prepare) -> dict[str, torch.Tensor]:
    """The gradient of the task's loss on one batch."""
    task.step(model, prepare(model, batch)).loss.backward()
    return _grads(model)


def mean_of_means_grads(
    task: Task, model: nn.Module, batches: Sequence[Any], prepare: Prepare
) -> dict[str, torch.Tensor]:
    """The gradient the loop accumulated before: each micro-batch's mean weighted alike."""
    for batch in batches:
        (task.step(model, prepare(model, batch)).loss / len(batches)).backward()
    return _grads(model)


def max_deviation(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two gradients of the same parameters."""
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)
