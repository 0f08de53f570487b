"""The tensor-parallel plan of `core.nn.transformer.Block`, shared by every model built from it.

Megatron's split: column-wise into attention and the MLP, row-wise out of them, so each block costs one
all-reduce after attention and one after the MLP, forward and backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from core.errors import ConfigError


def check_tp_size(blocks: Sequence[nn.Module], tp_size: int, *, heads_key: str, width_key: str) -> None:
    """ConfigError unless every block's heads and MLP width divide evenly across `tp_size` ranks."""
    for block in blocks:
        if block.n_head % tp_size:
            raise ConfigError(
                f"{heads_key}={block.n_head} is not divisible by the tensor-parallel size tp={tp_size}; "
                "set trainer.tp to a divisor of it",
                key=heads_key,
                value=str(block.n_head),
                valid=(f"a multiple of trainer.tp={tp_size}",),
            )
        if block.fc.out_features % tp_size:
            raise ConfigError(
                f"the MLP width {block.fc.out_features} (from {width_key}) is not divisible by the "
                f"tensor-parallel size tp={tp_size}; set trainer.tp to a divisor of it",
                key=width_key,
                value=str(block.fc.out_features),
                valid=(f"a multiple of trainer.tp={tp_size}",),
            )


def parallelize_blocks(blocks: Sequence[nn.Module], tp_mesh: Any, *, heads_key: str, width_key: str) -> None:
    """Shard each block's attention by heads and its MLP by hidden units across the 1-D `tp_mesh`.

    `heads_key`/`width_key` name the config keys a size error points at. The block's inputs and outputs stay
    plain tensors, whole on every rank, so whatever surrounds the blocks runs unchanged.
    """
    check_tp_size(blocks, tp_mesh.size(), heads_key=heads_key, width_key=width_key)  # before sharding any
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        # rows are head-major (core.nn.transformer), so a contiguous row shard is whole heads with their q,
        # k, v
        "qkv_by_head": ColwiseParallel(),
        "proj": RowwiseParallel(),
        "fc": ColwiseParallel(),
        "fc_out": RowwiseParallel(),
    }
    for block in blocks:
        parallelize_module(block, tp_mesh, plan)
