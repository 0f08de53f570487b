"""`MeshShape` owns what the loop derives from the mesh sizes: data-parallel index, replicas, layout, clip."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.distributed import MeshShape
from core.distributed.parallelize import optimizer_impl


def test_a_2x2x2_mesh_gives_each_rank_its_data_parallel_index() -> None:
    shape = MeshShape(dp_replicate=2, dp_shard=2, tp=2)
    assert (shape.world_size, shape.dp_size, shape.replicas) == (8, 4, 2)
    # tp innermost: ranks 2k and 2k+1 hold one replica and read the same batches
    assert [shape.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert shape.layout() == {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    assert shape.names() == ("dp_replicate", "dp_shard", "tp")


def test_one_process_is_the_degenerate_shape() -> None:
    shape = MeshShape()
    assert (shape.world_size, shape.dp_size, shape.replicas, shape.dp_rank(0), shape.names()) == (
        1,
        1,
        1,
        0,
        (),
    )


def test_a_new_dimension_is_one_field() -> None:
    @dataclasses.dataclass(frozen=True)
    class WithContextParallel(MeshShape):
        cp: int = 1  # not a data dimension: its ranks hold parts of one replica's sequences

    shape = WithContextParallel(dp_shard=2, tp=2, cp=2)
    assert (shape.world_size, shape.dp_size, shape.replicas) == (8, 2, 4)
    assert [shape.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert shape.layout()["cp"] == 2 and shape.names() == ("dp_shard", "tp", "cp")


@pytest.mark.parametrize("shape", [MeshShape(), MeshShape(tp=2)])
@pytest.mark.parametrize("scale", [3.0, 0.01])  # a norm over the limit (clipped), and one under it (not)
def test_both_clips_match_torchs_on_plain_gradients(shape: MeshShape, scale: float) -> None:
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64)) for _ in range(3)]
    for p in ref:
        p.grad = torch.randn_like(p) * scale
    got = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    for g, p in zip(got, ref, strict=True):
        g.grad = p.grad.clone()
    want = float(torch.nn.utils.clip_grad_norm_(ref, 1.0))
    assert (want > 1.0) == (scale > 1.0)
    norm = shape.clip_grad_norm(got, 1.0)
    assert norm == pytest.approx(want, rel=1e-12)
    for g, p in zip(got, ref, strict=True):
        torch.testing.assert_close(g.grad, p.grad, rtol=1e-12, atol=0)
    if shape == MeshShape():  # the single-replica path is torch's own arithmetic: bit for bit
        assert all(torch.equal(g.grad, p.grad) for g, p in zip(got, ref, strict=True))


def test_the_optimizer_implementation_follows_the_layout() -> None:
    assert optimizer_impl(MeshShape(), "fused", "adamw") == "fused"
    assert optimizer_impl(MeshShape(tp=2), "fused", "adamw") == "default"  # DTensors beside plain tensors
    assert optimizer_impl(MeshShape(dp_shard=2), "fused", "sgd") == "foreach"
    assert optimizer_impl(MeshShape(dp_shard=2), "fused", "adamw") == "fused"
