"""Expert parallelism (`trainer.ep`): a mixture's stacked experts split over the ranks of the `ep` mesh
dimension, and the rows routed to them carried there and back with torch.distributed's all-to-all.

The protocol a model keeps to: a module holding stacked experts has an
`ep_group` attribute, None until `shard_experts` sets it, and each of its own parameters is (expert, ...).
Its forward, given rows sorted by expert and the rows per expert, calls `run_on_expert_shards` when the
group is set, and takes its weights through `expert_shards`.

One step of an expert layer on rank r of `ep`: the rows per expert are exchanged first (an all-to-all of
E counts), so each rank knows how many rows it will receive from each other rank; the rows go to the rank
holding their expert (all-to-all, uneven splits), are sorted there by local expert and run; the outputs go
back the same way. Both all-to-alls are torch's autograd-aware functional collective
(`torch.distributed._functional_collectives.all_to_all_single_autograd`, torchtitan's; torch 2.14
deprecates `torch.distributed.nn.functional`'s): backward sends the gradients along the reverse routes. The
`ep` ranks read different batches (a data dimension, torchtitan's layout): the non-expert parameters are
FSDP-sharded over them (`core.distributed.parallelize.data_parallel`), the experts over the other data ranks
only.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from core.errors import ConfigError


class ExpertCompute(Protocol):
    """This rank's experts on rows sorted by local expert, `counts` rows each."""

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor: ...


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that hold stacked experts (those with an `ep_group` attribute)."""
    return [m for m in model.modules() if hasattr(m, "ep_group")]


def check_expert_split(model: nn.Module, ep: int) -> None:
    """ConfigError naming `trainer.ep` unless `model` has experts and each expert module's count divides
    evenly over `ep` ranks."""
    modules = expert_modules(model)
    if not modules:
        raise ConfigError(
            f"trainer.ep={ep} splits a mixture's experts over ranks, but {type(model).__name__} has no "
            "experts; use trainer.ep=1",
            key="trainer.ep",
            value=str(ep),
            valid=("1",),
        )
    for module in modules:
        n = next(module.parameters()).shape[0]
        if n % ep:
            raise ConfigError(
                f"trainer.ep={ep} does not divide the model's {n} experts (model.n_experts); set trainer.ep "
                "to a divisor of it",
                key="trainer.ep",
                value=str(ep),
                valid=(f"a divisor of {n}",),
            )


def shard_experts(model: nn.Module, ep_mesh: Any) -> nn.Module:
    """Split each expert module's parameters by expert over the 1-D `ep_mesh` (DTensors, `Shard(0)`: DCP
    saves and reshards them as any other layout) and route its rows through `ep_mesh`'s group."""
    from torch.distributed.tensor import Shard, distribute_tensor

    check_expert_split(model, ep_mesh.size())  # before any module is changed
    for module in expert_modules(model):
        for name, param in list(module.named_parameters(recurse=False)):
            # every rank built the same whole tensor (seeded, or meta): each keeps its slice, nothing is sent
            shard = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        module.ep_group = ep_mesh.get_group()
    return model


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def expert_shards(
    weights: tuple[torch.Tensor, ...], group: Any, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """This rank's experts of each stacked weight (a DTensor split by `shard_experts`), in `dtype`.

    Their gradients are divided by the `ep` group's size: an expert shard receives, through the
    all-to-all's backward, the gradient of every `ep` rank's batch summed, while the data-parallel ranks'
    gradients of every other parameter are averaged (FSDP divides by its group's size); so both end as the
    mean over the data-parallel ranks, as one process of the global batch computes."""
    scale = 1.0 / torch.distributed.get_world_size(group)
    local = (w.to_local() if hasattr(w, "to_local") else w for w in weights)
    return tuple(_ScaleGradient.apply(w, scale).to(dtype) for w in local)


def run_on_expert_shards(
    x: torch.Tensor, counts: torch.Tensor, compute: ExpertCompute, group: Any
) -> torch.Tensor:
    """Each row of `x` (N, dim), sorted by expert with `counts` (E,) rows each, through its expert on the
    rank of `group` that holds it (rank j: experts j*E/ep to (j+1)*E/ep - 1); the outputs in `x`'s order."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    ep = dist.get_world_size(group)
    local = counts.shape[0] // ep
    # received[j, e]: rows rank j sends for this rank's expert e. A dry run's fake group writes nothing:
    # starting from this rank's own counts, its sizes stand for ranks that all route alike
    received = counts.clone()
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(ep, local)
    sent = counts.view(ep, local).sum(1).tolist()  # the host reads the sizes: the collective needs them
    arrived = received.sum(1).tolist()
    rows = all_to_all_single_autograd(x.contiguous(), arrived, sent, group)
    # rows arrive by source rank, then by expert: sorted by expert alone (stably) for the grouped GEMMs
    expert = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(received.flatten())
    order = expert.argsort(stable=True)
    out = compute(rows[order], received.sum(0))
    out = out[order.argsort()]
    return all_to_all_single_autograd(out.contiguous(), sent, arrived, group)
