"""Under torchrun (2 gloo ranks): FSDP2 through the parallelize stage with each activation-checkpointing
mode; rank 0 writes OUT/grads.pt, {"MODE:EVERY": full gradients by name} of one float64 step on the global
batch (each rank takes its half), for `test_activation_checkpoint.py` to compare with one process.

`python -m torch.distributed.run --nproc_per_node=2 tests/core/dist_ac.py OUT`
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from core.distributed import MeshShape, build_mesh, dist_env, group  # noqa: E402
from core.distributed.parallelize import parallelize  # noqa: E402
from tests.core.ac_model import TinyLM, loss_and_grads, tokens  # noqa: E402

CASES = (("none", 1), ("full", 1), ("selective", 1), ("full", 2))


def main() -> None:
    """One FSDP step per case; rank 0 saves the gathered gradients."""
    out = Path(sys.argv[1])
    env = dist_env()
    group.start("cpu", env)
    shape = MeshShape(dp_shard=env.world_size)
    mesh = build_mesh(shape, "cpu")
    batch = tokens(batch=4)
    share = batch.shape[0] // env.world_size
    mine = batch[env.rank * share : (env.rank + 1) * share]
    found = {}
    for mode, every in CASES:
        torch.manual_seed(0)
        model = TinyLM(dropout=0.0).double()  # each rank its own dropout stream: no dropout across ranks
        model = parallelize(model, shape, mesh, activation_checkpointing=mode, checkpoint_every=every)
        found[f"{mode}:{every}"] = loss_and_grads(model, mine)[1]
    if env.is_main:
        torch.save(found, out / "grads.pt")
    group.stop()
    group.exit_process(0)


if __name__ == "__main__":
    main()
