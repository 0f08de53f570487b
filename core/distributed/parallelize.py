"""Data parallelism applied to a model from outside, after tensor parallel and compile (torchtitan's order):
FSDP2 (`fully_shard` each repeated block, then the root) on the `dp_shard` dimension (HSDP when
`dp_replicate` > 1 too), or DDP on `dp_replicate` alone; `gradient_sync` turns their gradient reduction off
for the micro-batches of an accumulation group but its last.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from core.compile.blocks import find_blocks
from core.distributed.mesh import MeshShape


def data_parallel(
    model: nn.Module, mesh: Any, shape: MeshShape, *, param_dtype: torch.dtype | None
) -> nn.Module:
    """`model` sharded (FSDP2) or replicated (DDP) across the mesh's data-parallel ranks; `param_dtype` is
    the device plan's compute dtype for FSDP's mixed-precision policy (None: parameters stay fp32)."""
    if shape.dp_shard > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dims = ("dp_replicate", "dp_shard") if shape.dp_replicate > 1 else ("dp_shard",)
        dp_mesh = mesh[dims]
        # gradients are reduced in fp32 whatever the compute dtype: bf16 sums lose the small updates; without
        # a compute dtype, in the parameters' own (a float64 model's gradients are not cut to fp32)
        reduce_dtype = torch.float32 if param_dtype is not None else None
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for block in find_blocks(model):
            fully_shard(block, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
        return model
    if shape.dp_replicate > 1:
        from torch.nn.parallel import DistributedDataParallel

        device = next(model.parameters()).device
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=mesh["dp_replicate"].get_group(),
        )
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within, the forward and backward of a model `data_parallel` wrapped reduce gradients across ranks
    only when `enabled` (the last micro-batch of an accumulation group): the others accumulate locally, so
    a group costs one micro-batch's gradient collectives, not one per micro-batch. A no-op otherwise."""
    if enabled or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        yield
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        with model.no_sync():  # DDP's forward reads the flag too: it must wrap both passes
            yield
    elif isinstance(model, FSDPModule):
        # on the root with recurse (the default): every sharded block skips its reduce-scatter (and HSDP's
        # all-reduce); the sync is restored even when the micro-batch raises
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:  # tensor parallel alone: its collectives carry activations, which no micro-batch can skip
        yield


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> float:
    """`nn.utils.clip_grad_norm_` for tensor-parallel models, whose gradients mix DTensors on different
    meshes (tensor-parallel layers; with FSDP, 2-D ones) and plain or 1-D ones (the replicated embeddings and
    norms), which torch's fused norm refuses to combine: each gradient's norm is taken on its own (a
    DTensor's reduces over its shards), then every gradient is scaled by one Python float. Returns the total
    norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    squares = 0.0
    for g in grads:
        n = torch.linalg.vector_norm(g)
        squares += float(n.full_tensor() if hasattr(n, "full_tensor") else n) ** 2
    total = squares**0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return total
