"""core/distributed/expert_parallel.py on a toy mixture that names no domain: stacked linear experts split
over 2 gloo ranks compute, through `run_on_expert_shards`, the outputs and gradients of one process (float64,
reference: the same experts whole in this process), uneven and empty routes included; and an `ep` that does
not split the experts is a ConfigError naming trainer.ep."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from core.distributed.expert_parallel import (
    check_expert_split,
    expert_shards,
    run_on_expert_shards,
    shard_experts,
)
from core.errors import ConfigError
from tests.helpers import fault

EXPERTS, DIM = 4, 3
TOL = 1e-12  # float64; the split moves where rows are computed, and the gradient scale 1/2 is exact
#: per rank: the expert of each of its rows, sorted (rank 1 sends nothing to expert 3, rank 0 nothing to 0)
ROUTES = [[1, 1, 2, 3, 3, 3], [0, 0, 0, 0, 1, 2, 2]]


class ToyExperts(nn.Module):
    """`EXPERTS` linear maps stacked (expert, out, in), run on rows sorted by expert."""

    def __init__(self) -> None:
        """Seeded weights."""
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, DIM, DIM, generator=torch.Generator().manual_seed(0)))
        self.ep_group = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each row through its expert, on the rank that holds it when split."""
        if self.ep_group is not None:
            return run_on_expert_shards(x, counts, self.run, self.ep_group)
        return self.run(x, counts)

    def run(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts held here on their rows."""
        (w,) = (
            (self.weight,) if self.ep_group is None else expert_shards((self.weight,), self.ep_group, x.dtype)
        )
        return torch.cat([r @ w[e].T for e, r in enumerate(x.split(counts.tolist()))])


def rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows (float64) and its counts per expert."""
    x = torch.randn(len(ROUTES[rank]), DIM, generator=torch.Generator().manual_seed(10 + rank))
    return x.double(), torch.bincount(torch.tensor(ROUTES[rank]), minlength=EXPERTS)


def toy_worker(rank: int, world: int, out_dir: str) -> None:
    """The toy experts split over both ranks: this rank's outputs, its input's gradient and the whole weight
    gradient."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank, world_size=world
    )
    model = shard_experts(ToyExperts().double(), init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    x, counts = rows(rank)
    x.requires_grad_(True)
    out = model(x, counts)
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    held = model.weight.to_local().shape[0]
    # clone: the all-to-all's result is an AsyncCollectiveTensor, which torch.save pickles as its class
    result = {
        "out": out.detach().clone(),
        "x_grad": x.grad,
        "w_grad": model.weight.grad.full_tensor(),
        "held": held,
    }
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes, 20 s on 2 loaded cores
def test_experts_split_over_2_ranks_compute_one_process_outputs_and_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(toy_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    ref = ToyExperts().double()
    for rank in range(2):
        x, counts = rows(rank)
        x.requires_grad_(True)
        out = ref(x, counts)
        # the ranks' losses averaged, as data-parallel ranks' gradients are
        ((out * torch.arange(out.numel()).view_as(out)).sum() / 2).backward()
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["held"] == EXPERTS // 2
        torch.testing.assert_close(got["out"], out.detach(), atol=TOL, rtol=0)
        torch.testing.assert_close(got["x_grad"], 2 * x.grad, atol=TOL, rtol=0)  # its own loss, unhalved
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        torch.testing.assert_close(got["w_grad"], ref.weight.grad, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    ("model", "ep", "valid"),
    [(ToyExperts(), 3, ("a divisor of 4",)), (nn.Linear(2, 2), 2, ("1",))],
)
def test_an_ep_that_does_not_split_the_experts_is_a_config_error(
    model: nn.Module, ep: int, valid: tuple
) -> None:
    with pytest.raises(ConfigError) as err:
        check_expert_split(model, ep)
    assert fault(err.value) == ("trainer.ep", str(ep), valid)
