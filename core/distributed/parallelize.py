"""The model-transform stage: one `parallelize(model, shape, mesh, ...)` for one process and for many.

The order is torchtitan's, each transform seeing the one before's output:
  0. LoRA (`core.nn.lora.apply_lora`, when `lora.rank` > 0): the targeted linear layers gain adapters, every
     other parameter is frozen; so checkpointing, compile and sharding all see the adapted model;
  1. tensor parallel on the `tp` mesh dimension (the model family's plan, `core.distributed.apply_tp`), then
     expert parallel on `ep` (the experts split by expert, `core.distributed.expert_parallel`);
  2. activation checkpointing of the repeated blocks (`core.distributed.activation_checkpoint`);
  3. compile (the caller's, per block or whole model): each block's graph holds its TP collectives and
     its checkpointed region;
  4. the caller's own hook (`Trainer(model_hook=...)`), on the model as compile left it;
  5. data parallel: FSDP2 (`fully_shard` each repeated block, then the root) on `dp_shard` (HSDP when
     `dp_replicate` > 1 too; with `ep`, the non-expert parameters over `dp_shard` x `ep` and the experts
     over `dp_shard` alone), or DDP on `dp_replicate` alone; sharding wraps what compile produced.
A one-process run is the degenerate case (`MeshShape()`, no mesh): steps 1 and 5 do nothing.
`optimizer_impl` is the optimizer implementation the result can take; `gradient_sync` turns the data-
parallel gradient reduction off for the micro-batches of an accumulation group but its last.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from core.compile.blocks import find_blocks
from core.distributed.activation_checkpoint import checkpoint_blocks
from core.distributed.expert_parallel import expert_modules, shard_experts
from core.distributed.mesh import MeshShape
from core.distributed.mesh import clip_grad_norm as clip_grad_norm  # (its home before MeshShape's)
from core.distributed.tensor_parallel import apply_tp
from core.nn.lora import LoRAConfig, apply_lora


def parallelize(
    model: nn.Module,
    shape: MeshShape,
    mesh: Any = None,
    *,
    activation_checkpointing: str = "none",
    checkpoint_every: int = 1,
    compile: Callable[[nn.Module], nn.Module] | None = None,
    hook: Callable[[nn.Module], nn.Module] | None = None,
    param_dtype: torch.dtype | None = None,
    lora: LoRAConfig | None = None,
) -> nn.Module:
    """`model` through the stage's transforms in their order (module docstring); `mesh` is the
    `DeviceMesh` of `shape` (None for one process), `param_dtype` FSDP's compute dtype (None: fp32)."""
    if lora is not None and lora.rank > 0:
        # targets match the model's own names, or the names it gives its modules in an outside layout
        apply_lora(model, lora, external_name=getattr(model, "external_name", None))
    if shape.tp > 1:
        model = apply_tp(model, mesh["tp"])
    if shape.ep > 1:
        model = shard_experts(model, mesh["ep"])
    checkpoint_blocks(model, activation_checkpointing, checkpoint_every)
    if compile is not None:
        model = compile(model)
    if hook is not None:
        model = hook(model)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model_hook returned {type(model).__name__}, not the nn.Module to train")
    return data_parallel(model, mesh, shape, param_dtype=param_dtype)


def optimizer_impl(shape: MeshShape, impl: str, optimizer: str) -> str:
    """The optimizer implementation (the device plan's `impl`: fused, foreach or default) that a model
    parallelized to `shape` can take."""
    if shape.replicas > 1 or shape.ep > 1:
        # fused and foreach AdamW refuse a group that mixes DTensors (tensor-parallel layers) with plain
        # tensors (the replicated rest), or DTensors on different meshes (experts beside FSDP's shards):
        # the per-parameter implementation takes both
        return "default"
    if impl == "fused" and shape.dp_shard > 1 and optimizer == "sgd":
        return "foreach"  # torch has no sharding rule for fused SGD on FSDP's DTensors (fused AdamW has)
    return impl


def data_parallel(
    model: nn.Module, mesh: Any, shape: MeshShape, *, param_dtype: torch.dtype | None
) -> nn.Module:
    """`model` sharded (FSDP2) or replicated (DDP) across the mesh's data-parallel ranks; `param_dtype` is
    the device plan's compute dtype for FSDP's mixed-precision policy (None: parameters stay fp32)."""
    if shape.dp_shard > 1 or shape.ep > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # gradients are reduced in fp32 whatever the compute dtype: bf16 sums lose the small updates; without
        # a compute dtype, in the parameters' own (a float64 model's gradients are not cut to fp32)
        reduce_dtype = torch.float32 if param_dtype is not None else None
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        ignored = _shard_experts_data(model, mesh, shape, mp) if shape.ep > 1 else None
        dp_mesh = _shard_mesh(mesh, shape)
        for block in find_blocks(model):
            fully_shard(block, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored)
        return model
    if shape.dp_replicate > 1:
        from torch.nn.parallel import DistributedDataParallel

        device = next(model.parameters()).device
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=mesh["dp_replicate"].get_group(),
            # a model that leaves some parameters out of some steps (layer drop, a frozen warm-up) says so:
            # DDP's reducer would otherwise wait for their gradients and fail at the next step
            find_unused_parameters=bool(getattr(model, "skips_parameters", False)),
        )
    return model


def _shard_mesh(mesh: Any, shape: MeshShape) -> Any:
    """The mesh FSDP shards the (non-expert) parameters over: `dp_shard` (x `ep`, flattened to one
    dimension), with `dp_replicate` before it for HSDP."""
    if shape.ep > 1:
        return mesh["ep"] if shape.dp_shard == 1 else mesh["dp_shard", "ep"]._flatten("dp_shard_ep")
    return mesh["dp_replicate", "dp_shard"] if shape.dp_replicate > 1 else mesh["dp_shard"]


def _shard_experts_data(model: nn.Module, mesh: Any, shape: MeshShape, mp: Any) -> set[nn.Parameter] | None:
    """FSDP over `dp_shard` for each expert module (its parameters already split over `ep`); without
    `dp_shard`, the expert parameters, for the blocks' FSDP to leave alone (each rank keeps its experts)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    modules = expert_modules(model)
    if shape.dp_shard == 1:
        return {p for m in modules for p in m.parameters()}
    for module in modules:
        held = next(module.parameters()).to_local().shape[0]
        # fewer experts here than FSDP ranks (ep x dp_shard > n_experts): dim 0 would leave ranks idle and
        # padded, so each expert's rows are split instead (torchtitan's choice)
        by_rows = None if held % shape.dp_shard == 0 else (lambda p: Shard(1))
        fully_shard(module, mesh=mesh["dp_shard"], mp_policy=mp, shard_placement_fn=by_rows)
    return None


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
