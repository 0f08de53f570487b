"""Runs under a cluster launcher (`hydra/launcher=slurm` or `submitit_local`): each submitit task one rank.

A submitit job of several tasks (`tasks_per_node` x `nodes`, one task per GPU) starts one Python process per
task, with no torchrun in between; this module gives each task the variables torchrun would have set, so
`core.distributed.dist_env()` and the process group see one launch. Preemption needs nothing here: the
trainer's stop signals include submitit's (SIGUSR2), and after its checkpoint the trainer calls the handler
it replaced, which is submitit's requeue (docs/scaling.md § Commands: clusters (SLURM)).
"""

from __future__ import annotations

import os

from core.distributed.launch import launched
from core.errors import ConfigError

#: torchrun's variables, set here from the submitit job's
TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def in_submitit_job() -> bool:
    """True inside a process a submitit executor started (SLURM or local)."""
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))


def export_task_ranks(nproc_per_node: int = 1) -> bool:
    """Inside a submitit job of several tasks and outside torchrun, set torchrun's variables from the job
    (rank = the task's global rank, the rendezvous at the first node on a port derived from the job id);
    True if it did. A single-task job stays one process (or torchrun's agent, with `dist.nproc_per_node`)."""
    if not in_submitit_job() or launched():
        return False
    import submitit

    job = submitit.JobEnvironment()
    if job.num_tasks <= 1:
        return False
    if nproc_per_node > 1:
        raise ConfigError(
            f"dist.nproc_per_node={nproc_per_node} in a job of {job.num_tasks} submitit tasks, each already "
            "one rank: use dist.nproc_per_node=1, or hydra.launcher.tasks_per_node=1 for torchrun's agent",
            key="dist.nproc_per_node",
            value=str(nproc_per_node),
            valid=("1",),  # under submitit tasks
        )
    # CUDA_VISIBLE_DEVICES stays as SLURM set it: the process group pins cuda:LOCAL_RANK itself.
    # overwrite: a requeued or nested job may inherit a previous launch's values; the job's are the truth.
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    return True
