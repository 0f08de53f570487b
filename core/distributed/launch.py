"""`dist.nproc_per_node=N` on a plain `python -m ...` command: this process becomes torchrun's elastic agent
and starts N workers running the same module, so one machine needs no torchrun command line.

The workers get `OMP_NUM_THREADS` = this machine's cores / N unless it is set (torchrun itself would set 1),
and whatever extra arguments the caller adds (the recipe passes the run directory it decided, so every rank
and every restart writes to one directory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated

from core.bounds import Bounds
from core.cpuload import usable_cpus


@dataclass
class DistConfig:
    """The `dist` config section: how many processes to start on this machine, and restarts."""

    #: >1 on a plain `python -m recipes.train` starts torchrun's elastic agent with that many processes
    nproc_per_node: Annotated[int, Bounds(ge=1)] = 1
    #: times the agent restarts all workers after one dies (they resume from the newest checkpoint)
    max_restarts: Annotated[int, Bounds(ge=0)] = 0
    #: the ranks a dry run (trainer.dry_run=true) lays the model out over, in this one process; 0: as many
    #: as nproc_per_node
    world_size: Annotated[int, Bounds(ge=0)] = 0


def launched() -> bool:
    """True inside a process that torchrun (or our agent) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def restarted() -> bool:
    """True in workers that torchrun's agent started again after a worker failed (the run should continue
    from its newest checkpoint, not start over in the same directory)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def run_agent(module: str, args: list[str], cfg: DistConfig) -> int:
    """Run `python -m module args` in `cfg.nproc_per_node` processes under torchrun's elastic agent (one
    machine, restarts as configured); the exit code is 0 or the failed worker's."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if "OMP_NUM_THREADS" not in os.environ:
        cores = usable_cpus()
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // cfg.nproc_per_node))
    argv = [
        "--standalone",
        f"--nproc_per_node={cfg.nproc_per_node}",
        f"--max_restarts={cfg.max_restarts}",
        "-m",
        module,
        *args,
    ]
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        _, first = e.get_first_failure()
        return first.exitcode if first.exitcode > 0 else 1
    return 0
