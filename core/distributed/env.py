"""Which launch this process is part of: torchrun's environment, read without importing torch.distributed."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    """This process's place in a launch: global rank and size, rank and size on this node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        """True when more than one process trains together."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """The process that prints, writes metrics and exports (global rank 0)."""
        return self.rank == 0


def dist_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """The launch described by torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); a
    plain `python` process is rank 0 of 1."""
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    return DistEnv(
        rank=int(env.get("RANK", "0")),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=local_world,
    )
