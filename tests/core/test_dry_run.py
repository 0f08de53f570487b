"""`core.distributed.dry_run`: a 256-rank FSDP layout laid out and stepped on one CPU with torch's fake
process group; rank 0's bytes and collectives against FSDP2's closed forms."""

from __future__ import annotations

import math

import torch.nn.functional as F

from core.distributed import MeshShape
from core.distributed.dry_run import dry_run
from tests.core.ac_model import TinyLM, tokens


def test_a_256_rank_fsdp_layout_has_rank_0s_shards_and_one_steps_collectives() -> None:
    world, layers = 256, 4

    def step(model):  # noqa: ANN001, ANN202
        batch = tokens(batch=1)
        return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    build = lambda: TinyLM(d=64, heads=4, layers=layers)  # noqa: E731
    report = dry_run(build, MeshShape(dp_shard=world), step=step, activation_checkpointing="full")
    # FSDP2 shards each parameter by rows: rank 0 holds ceil(rows / world) of them, fp32
    want = sum(math.ceil(p.shape[0] / world) * p[0].numel() * 4 for p in build().parameters())
    assert report.param_bytes == report.grad_bytes == want
    assert report.optimizer_bytes == 2 * want
    # each block gathered for forward and again for backward (resharded after forward), the root once;
    # every block's gradients and the root's reduce-scattered once
    assert report.collectives == {"all_gather": 2 * layers + 1, "reduce_scatter": layers + 1}
