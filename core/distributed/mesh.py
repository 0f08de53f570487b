"""`trainer.parallel` -> the sizes of a device mesh -> a named `DeviceMesh`.

Dimension names follow torchtitan: `dp_replicate` (DDP, or HSDP's replicas), `dp_shard` (FSDP2), `ep`
(expert parallel: a data dimension whose ranks split a mixture's experts, `trainer.ep`), `tp` (tensor
parallel). Their product is the world size; the innermost dimension is `tp`, so tensor-parallel
peers are neighbouring ranks (on one node, where the fast links are).

`MeshShape` owns every number derived from the sizes that the training loop uses (a data-parallel rank's
index, how many ranks repeat one replica's loss, the layout a checkpoint records, how gradients are
clipped): a new dimension is one field here (marked `data` when its ranks read different batches), one
branch in `core.distributed.parallelize` and one config key, and the loop is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from core.errors import ConfigError, unknown_choice

#: trainer.parallel values: none (one process), auto (ddp when launched with more than one process),
#: ddp, fsdp, tp, fsdp_tp (FSDP x TP on a 2-D mesh, trainer.tp wide), custom (trainer.dp_replicate,
#: trainer.dp_shard, trainer.tp as given)
PARALLEL_STYLES = ("none", "auto", "ddp", "fsdp", "tp", "fsdp_tp", "custom")


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the mesh dimensions, outermost first; 1 means the dimension is not used. Data dimensions
    (metadata `data`) come before the others: the ranks of one model replica are neighbours."""

    dp_replicate: int = dataclasses.field(default=1, metadata={"data": True})
    dp_shard: int = dataclasses.field(default=1, metadata={"data": True})
    # `optional`: left out of the layout when unused, so runs without it record the layout they always did
    ep: int = dataclasses.field(default=1, metadata={"data": True, "optional": True})
    tp: int = 1

    def layout(self) -> dict[str, int]:
        """Every dimension's size by name, used or not (what a checkpoint records as its layout)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) > 1 or not f.metadata.get("optional")
        }

    @property
    def world_size(self) -> int:
        """Processes the shape needs."""
        return _product(self.layout().values())

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (each reads its share of every global batch)."""
        return _product(getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("data"))

    @property
    def replicas(self) -> int:
        """Ranks that hold parts of one model replica and read the same batches (tensor-parallel peers):
        a sum of their losses or sample counts over all ranks counts each batch this many times."""
        return self.world_size // self.dp_size

    def require_whole(self, parallel: str, needs: str) -> None:
        """One-line ConfigError naming trainer.parallel unless every rank holds the whole model (no FSDP
        shard, no tensor-parallel split): what `needs` (e.g. "sampling") cannot do without."""
        if self.dp_shard > 1 or self.tp > 1:
            raise ConfigError(
                f"{needs} needs the whole weights on each rank, which trainer.parallel={parallel} shards: "
                "use trainer.parallel=ddp",
                key="trainer.parallel",
                value=parallel,
                valid=("ddp",),
            )

    def dp_rank(self, rank: int) -> int:
        """`rank`'s index among the data-parallel ranks; the ranks of one replica share it."""
        return rank // self.replicas

    def names(self) -> tuple[str, ...]:
        """The used dimensions' names, outermost first."""
        return tuple(n for n, size in self.layout().items() if size > 1)

    def clip_grad_norm(self, parameters: Iterable[Any], max_norm: float) -> float:
        """Clip the gradients to a total norm of `max_norm` over all ranks; returns the norm before. With
        the model split across ranks (`replicas` > 1), the gradients mix DTensors on different meshes and
        plain tensors, which torch's fused norm refuses to combine: each one's norm is taken on its own."""
        import torch

        params = list(parameters)
        if self.replicas > 1 or self.ep > 1:  # experts: DTensors on the `ep` mesh beside FSDP's
            return clip_grad_norm(params, max_norm)
        utils = torch.nn.utils
        if not hasattr(utils, "get_total_norm"):  # torch < 2.6 (the legacy job): the one-call form
            norm = utils.clip_grad_norm_(params, max_norm)
            return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
        norm = utils.get_total_norm([p.grad for p in params if p.grad is not None])
        total = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        # torch scales every gradient by min(1, max_norm / (norm + 1e-6)); at 1 that is a pass over all the
        # gradients (one multiply per tensor on CPU) that changes no bit, so it is skipped
        if max_norm / (total + 1e-6) < 1:
            utils.clip_grads_with_norm_(params, max_norm, norm)
        return total


def _product(sizes: Iterable[int]) -> int:
    out = 1
    for s in sizes:
        out *= s
    return out


def clip_grad_norm(parameters: list[Any], max_norm: float) -> float:
    """`nn.utils.clip_grad_norm_` for a model split across ranks, whose gradients mix DTensors on
    different meshes (tensor-parallel layers; with FSDP, 2-D ones) and plain or 1-D ones (the replicated
    embeddings and norms): each gradient's norm is taken on its own (a DTensor's reduces over its shards),
    then every gradient is scaled by one Python float. Returns the total norm before clipping."""
    import torch

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


def mesh_shape(
    parallel: str, world_size: int, *, tp: int = 2, dp_shard: int = -1, dp_replicate: int = 1, ep: int = 1
) -> MeshShape:
    """The mesh for a `trainer.parallel` style at `world_size` processes (-1 sizes fill the rest); `ep` > 1
    takes that many of the data-parallel ranks for the experts, the style laying out the rest."""
    if parallel not in PARALLEL_STYLES:
        raise unknown_choice("trainer.parallel", parallel, PARALLEL_STYLES)
    if ep > 1:
        if parallel not in ("fsdp", "fsdp_tp", "custom") or world_size % ep:
            raise ConfigError(
                f"trainer.ep={ep} needs trainer.parallel=fsdp, fsdp_tp or custom and a divisor of the "
                f"{world_size} processes launched",
                key="trainer.ep",
                value=str(ep),
            )
        shape = dataclasses.replace(
            mesh_shape(parallel, world_size // ep, tp=tp, dp_shard=dp_shard, dp_replicate=dp_replicate), ep=ep
        )
        if shape.dp_replicate > 1:  # HSDP beside the experts: not wired (data_parallel's meshes)
            raise ConfigError(
                f"trainer.ep={ep} does not run with trainer.dp_replicate={shape.dp_replicate} yet",
                key="trainer.ep",
                value=str(ep),
            )
        return shape
    if parallel == "none" or (parallel == "auto" and world_size == 1):
        if world_size > 1:
            raise ConfigError(
                f"trainer.parallel=none but {world_size} processes were launched; use trainer.parallel=ddp"
                "|fsdp|tp|fsdp_tp, or launch one process"
            )
        return MeshShape()
    if parallel in ("auto", "ddp"):
        shape = MeshShape(dp_replicate=world_size)
    elif parallel == "fsdp":
        shape = MeshShape(dp_shard=world_size)
    elif parallel == "tp":
        shape = MeshShape(tp=world_size)
    else:
        tp_size = tp if parallel in ("fsdp_tp", "custom") else 1
        if tp_size < 1 or world_size % tp_size:
            raise ConfigError(f"trainer.tp={tp} must divide the {world_size} processes launched")
        rest = world_size // tp_size
        if parallel == "fsdp_tp":
            shape = MeshShape(dp_shard=rest, tp=tp_size)
        else:
            replicate = dp_replicate if dp_replicate > 0 else rest // max(dp_shard, 1)
            shard = dp_shard if dp_shard > 0 else rest // max(replicate, 1)
            shape = MeshShape(dp_replicate=replicate, dp_shard=shard, tp=tp_size)
    if shape.world_size != world_size:
        raise ConfigError(
            f"trainer.parallel={parallel}: dp_replicate={shape.dp_replicate} x dp_shard={shape.dp_shard} x "
            f"tp={shape.tp} = {shape.world_size} processes, but {world_size} were launched"
        )
    return shape


def training_mesh(
    parallel: str,
    world_size: int,
    *,
    tp: int,
    dp_shard: int,
    dp_replicate: int,
    batch_size: int,
    ep: int = 1,
) -> MeshShape:
    """`mesh_shape` for a training run, whose global batch (`trainer.batch_size`) must split evenly among
    the data-parallel ranks: the one check for the CLI (before any process group) and the trainer."""
    shape = mesh_shape(parallel, world_size, tp=tp, dp_shard=dp_shard, dp_replicate=dp_replicate, ep=ep)
    if batch_size % shape.dp_size:
        raise ConfigError(
            f"trainer.batch_size={batch_size} (the global batch) must divide evenly among the "
            f"{shape.dp_size} data-parallel ranks"
        )
    return shape


def build_mesh(shape: MeshShape, device_type: str) -> Any:
    """A `DeviceMesh` over all ranks with `shape`'s used dimensions named (a 1-D mesh for one style); the
    process group must already be initialised."""
    from torch.distributed.device_mesh import init_device_mesh

    names = shape.names() or ("dp_replicate",)
    sizes = tuple(getattr(shape, n) for n in names)
    return init_device_mesh(device_type, sizes, mesh_dim_names=names)
