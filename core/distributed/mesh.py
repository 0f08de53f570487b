"""`trainer.parallel` -> the sizes of a device mesh -> a named `DeviceMesh`.

Dimension names follow torchtitan: `dp_replicate` (DDP, or HSDP's replicas), `dp_shard` (FSDP2), `tp`
(tensor parallel). Their product is the world size; the innermost dimension is `tp`, so tensor-parallel
peers are neighbouring ranks (on one node, where the fast links are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.errors import ConfigError

#: trainer.parallel values: none (one process), auto (ddp when launched with more than one process),
#: ddp, fsdp, tp, fsdp_tp (FSDP x TP on a 2-D mesh, trainer.tp wide), custom (trainer.dp_replicate,
#: trainer.dp_shard, trainer.tp as given)
PARALLEL_STYLES = ("none", "auto", "ddp", "fsdp", "tp", "fsdp_tp", "custom")


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the mesh dimensions; 1 means the dimension is not used."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        """Processes the shape needs."""
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (each reads its share of every global batch)."""
        return self.dp_replicate * self.dp_shard

    def names(self) -> tuple[str, ...]:
        """The used dimensions' names, outermost first."""
        return tuple(n for n in ("dp_replicate", "dp_shard", "tp") if getattr(self, n) > 1)


def mesh_shape(
    parallel: str, world_size: int, *, tp: int = 2, dp_shard: int = -1, dp_replicate: int = 1
) -> MeshShape:
    """The mesh for a `trainer.parallel` style at `world_size` processes (-1 sizes fill the rest)."""
    if parallel not in PARALLEL_STYLES:
        raise ConfigError(f"trainer.parallel={parallel} is unknown; valid: {', '.join(PARALLEL_STYLES)}")
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
    parallel: str, world_size: int, *, tp: int, dp_shard: int, dp_replicate: int, batch_size: int
) -> MeshShape:
    """`mesh_shape` for a training run, whose global batch (`trainer.batch_size`) must split evenly among
    the data-parallel ranks: the one check for the CLI (before any process group) and the trainer."""
    shape = mesh_shape(parallel, world_size, tp=tp, dp_shard=dp_shard, dp_replicate=dp_replicate)
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
