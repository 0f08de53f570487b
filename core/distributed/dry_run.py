"""A large layout tried on one CPU: torch's fake process group stands in for `world_size` ranks, the real
parallelize stage is applied to the real model built on the meta device, and rank 0's share is counted.

The fake group (`torch.testing._internal.distributed.fake_pg`, torchtitan's dry-run tool) answers every
collective at once without moving data, so building the mesh, sharding (FSDP2, TP) and, optionally, one
training step (`step`) run as on rank 0 of the real job. Parameters live on the meta device until the step,
so a model far larger than this machine's memory is laid out in seconds; the step materialises rank 0's
shards only (uninitialised: their values do not matter here) and counts the collectives it issues.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from core.distributed.mesh import MeshShape, build_mesh
from core.distributed.parallelize import parallelize
from core.errors import ConfigError


@dataclass(frozen=True)
class DryRunReport:
    """Rank 0's bytes and, when a step ran, the collectives one step issued (by op name)."""

    shape: MeshShape
    param_bytes: int
    grad_bytes: int
    #: AdamW's two moments per trainable parameter, in the parameters' dtype
    optimizer_bytes: int
    collectives: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        """One line: the mesh, rank 0's bytes, the step's collectives."""
        mib = 2**20
        mesh = " x ".join(f"{n}={getattr(self.shape, n)}" for n in self.shape.names())
        comms = ", ".join(f"{op} x{n}" for op, n in sorted(self.collectives.items())) or "none"
        return (
            f"dry run: {self.shape.world_size} ranks, mesh {mesh}; rank 0 holds parameters "
            f"{self.param_bytes / mib:.2f} MiB, gradients {self.grad_bytes / mib:.2f} MiB, AdamW moments "
            f"{self.optimizer_bytes / mib:.2f} MiB; one micro-batch's forward and backward: {comms}"
        )

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready numbers (the recipe writes it to dry_run.json)."""
        return {
            "world_size": self.shape.world_size,
            "mesh": {n: getattr(self.shape, n) for n in self.shape.names()},
            "param_bytes": self.param_bytes,
            "grad_bytes": self.grad_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "collectives": dict(self.collectives),
        }


def dry_run(
    build: Callable[[], nn.Module],
    shape: MeshShape,
    *,
    step: Callable[[nn.Module], torch.Tensor] | None = None,
    **transforms: Any,
) -> DryRunReport:
    """Lay `build()` out over `shape` with `parallelize(..., **transforms)` as rank 0 of `shape.world_size`
    fake ranks; with `step(model) -> loss`, run one forward and backward and count its collectives."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("dry_run starts its own (fake) process group; this process already has one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=shape.world_size)
    try:
        mesh = build_mesh(shape, "cpu")
        with torch.device("meta"):
            model = build()
        model = parallelize(model, shape, mesh, **transforms)
        local = [_local(p) for p in model.parameters()]
        params = sum(t.numel() * t.element_size() for t in local)
        trainable = sum(
            t.numel() * t.element_size()
            for t, p in zip(local, model.parameters(), strict=True)
            if p.requires_grad
        )
        counts: dict[str, int] = {}
        if step is not None:
            from torch.distributed.tensor.debug import CommDebugMode

            model.to_empty(device="cpu")  # rank 0's shards only
            with CommDebugMode() as comm:
                step(model).backward()
            for op, n in comm.get_comm_counts().items():
                counts[_collective(op)] = counts.get(_collective(op), 0) + n
        return DryRunReport(shape, params, trainable, 2 * trainable, counts)
    finally:
        dist.destroy_process_group()


def _collective(op: Any) -> str:
    """A collective's plain name (all_gather, reduce_scatter, all_reduce, ...), whether c10d's op
    (`_allgather_base_`) or the functional one (`all_gather_into_tensor`) issued it."""
    name = str(op).split(".")[-1].strip("_").removesuffix("_base")
    name = name.replace("allgather", "all_gather").replace("allreduce", "all_reduce")
    return name.removesuffix("_into_tensor").removesuffix("_tensor")


def in_one_process() -> ConfigError:
    """The error for a dry run started as several processes: it is one process standing in for them."""
    return ConfigError(
        "trainer.dry_run=true stands in for the ranks in one process; drop dist.nproc_per_node and torchrun, "
        "and give the ranks as dist.world_size=N",
        key="trainer.dry_run",
        value="true",
    )


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p
