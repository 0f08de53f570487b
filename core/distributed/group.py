"""The process group of a multi-process run: started once the config is valid, and the few collectives the
loop needs (loss and throughput reduced across ranks, the run directory agreed on).

torch.distributed is imported here only, and only when a launch has more than one process.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch

from core.device import DevicePlan, resolve
from core.distributed.env import DistEnv, dist_env


def backend_for(device_type: str) -> str:
    """NCCL for CUDA tensors (gloo beside it for CPU ones: small control messages, object broadcasts), gloo
    alone between CPU processes."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def start(device_type: str, env: DistEnv | None = None) -> DistEnv:
    """Join this launch's process group (no-op for one process or when already joined); each rank of a CUDA
    run pins the GPU of its local rank first, so NCCL and every allocation land there."""
    env = dist_env() if env is None else env
    if not env.distributed:
        return env
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
    if not dist.is_initialized():
        # a rank that dies is found by the others' collectives timing out; 10 minutes covers slow first
        # compiles and checkpoint writes without leaving a hung job for hours (torch's default is 30 min)
        timeout = datetime.timedelta(seconds=int(os.environ.get("TORCHKILN_DIST_TIMEOUT", "600")))
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun's store outlives a restart of the workers, and with it the dead workers' addresses:
        # restarted workers read those, and gloo waits on them until the timeout (seen with --standalone
        # and --max-restarts). Each restart attempt gets its own key space.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"torchkiln/attempt_{attempt}", store)
        dist.init_process_group(
            backend_for(device_type), store=store, rank=rank, world_size=world, timeout=timeout
        )
    return env


def start_with_plan(device: str, precision: str, mps_fallback: bool, env: DistEnv) -> DevicePlan:
    """This process's device plan, applied: under several ranks, each pins the GPU of its local rank, joins
    the process group, and on CPU takes its share of the machine's cores."""
    plan = resolve(device, precision, mps_fallback=mps_fallback)
    if env.distributed and plan.device.type == "cuda" and plan.device.index is None:
        plan = resolve(f"cuda:{env.local_rank}", precision, mps_fallback=mps_fallback)
    plan.apply()
    if env.distributed:
        start(plan.device.type, env)
        if plan.device.type == "cpu":
            # ranks on one machine share its cores: the plan's count split among them, unless the
            # launcher set OMP_NUM_THREADS (our launcher does: cores / ranks)
            each = int(os.environ.get("OMP_NUM_THREADS", "0")) or plan.num_threads // env.local_world_size
            torch.set_num_threads(max(1, each))
    return plan


def stop(*, wait: bool = True) -> None:
    """Leave the process group, if one was joined; with `wait`, first meet every rank, so none tears its
    connections down while a peer still uses them (gloo then aborts the peer's process). A failing rank
    leaves without waiting: the others may never arrive."""
    if dist_env().distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            if wait:
                dist.barrier()
            dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a rank that has left its process group: flush, then `os._exit`, skipping the interpreter's
    teardown, where c10d objects still referenced (device meshes, sharded modules) were seen to abort the
    process ("terminate called without an active exception", exit -6) after a successful run."""
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum of `values` over all ranks (one collective); unchanged for one process."""
    if not _joined():
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def all_gather_cat(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every rank's 1-D `values` (their lengths may differ), concatenated in rank order on `device`;
    `values` itself for one process."""
    if not _joined():
        return values
    import torch.distributed as dist

    world = dist.get_world_size()
    count = torch.tensor([values.numel()], dtype=torch.long, device=device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    sizes = [int(c.item()) for c in counts]
    padded = torch.zeros(max(sizes), dtype=values.dtype, device=device)
    padded[: values.numel()] = values.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is true on any (e.g. a stop signal that reached one rank)."""
    return all_reduce_sum([1.0 if flag else 0.0], device)[0] > 0


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (objects between our own ranks only: pickled, never from a file)."""
    if not _joined():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait for every rank."""
    if _joined():
        import torch.distributed as dist

        dist.barrier()


def _joined() -> bool:
    if not dist_env().distributed:
        return False
    import torch.distributed as dist

    return dist.is_initialized()
