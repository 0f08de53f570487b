"""Gradient accumulation weighted by loss units, over an accumulation group and every data-parallel rank.

Each micro-batch's loss is a mean over its units (`Task.loss_units`: tokens, utterances, examples). Summing
means divided by the micro-batch count (a mean of means) weights a micro-batch of 5 examples like one of 10;
a batch of the same 15 examples weights each example alike. So the loop turns each mean back into its sum
and divides by the units of the whole group on all data-parallel ranks, counted once per optimizer step
before any backward (torchtitan's `global_valid_tokens`, torchtune's token-normalised accumulation).
DDP and FSDP average gradients over the data-parallel ranks, so the weights carry the rank count back in:
the reduced gradient is the gradient of the mean over all of the group's units.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.distributed import group as dgroup


def group_weights(
    units: Sequence[int], device: torch.device, *, dp_size: int = 1, tp: int = 1
) -> list[float]:
    """The factor each micro-batch's mean loss is multiplied by before its backward: its units over the
    group's units on all data-parallel ranks (one all-reduce for several processes), times `dp_size` (the
    ranks DDP/FSDP average the gradients over). `tp`: ranks of one model replica, which read the same
    batches, so the all-reduced total counts their units `tp` times. A group with no units at all weighs
    nothing (its losses are empty means)."""
    total = float(sum(units))
    if dp_size * tp > 1:
        total = dgroup.all_reduce_sum([total], device)[0] / tp
    if total == 0:
        return [0.0] * len(units)
    # a Python float per micro-batch: equal micro-batches of one process get exactly 1.0 / K
    return [u * dp_size / total for u in units]
