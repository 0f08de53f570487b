"""Expert parallelism of the MoE decoder (`trainer.ep`, core/distributed/expert_parallel.py, text/moe.py) in
real gloo processes: the model laid out by the parallelize stage at ep=2 computes one process's outputs and
gradients, balancing loss included. Reference: the same seeded model in this process, unsharded, float64."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from core.distributed import MeshShape, build_mesh
from core.distributed.parallelize import parallelize
from tests.text import parallel_cases as cases
from text.llama import DecoderConfig, Llama
from text.moe import router_balance

# float64; EP moves rows between ranks and FSDP averages gradients: only the sums' order changes. Measured
# worst (torch 2.14, CPU): outputs 0, gradients 4e-17 at ep=2 and 2e-15 at ep=2 x fsdp=2
EP_TOL = 1e-10
ROWS = 2  # per data-parallel rank


def moe() -> Llama:
    """A random three-block MoE decoder in float64 (the middle block dense), 4 experts, 2 per token."""
    sizes = {"vocab_size": cases.VOCAB, "context": cases.LEN, "n_layer": 3, "n_head": 4, "n_kv_head": 2}
    sizes |= {"d_model": 32, "hidden": 48, "n_experts": 4, "experts_per_token": 2, "expert_hidden": 16}
    torch.manual_seed(5)
    return Llama(DecoderConfig(**sizes, dense_layers=(1,), router_aux_loss_coef=0.1)).double()


def loss(model: torch.nn.Module, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs, loss) of data-parallel rank `rank`'s rows: a fixed random cotangent, plus the balancing
    loss."""
    out = model(cases.tokens(4 * ROWS, 30)[rank * ROWS : (rank + 1) * ROWS])  # up to 4 ranks
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank), dtype=out.dtype)
    return out.detach(), (out * cotangent).sum() + router_balance(model).loss


def ep_worker(rank: int, world: int, out_dir: str, dp_shard: int) -> None:
    """The MoE decoder through `parallelize` at ep=2 (x `dp_shard`): this rank's outputs and the whole
    gradients, saved per rank."""
    import torch.distributed as dist

    cases._start(rank, world, os.path.join(out_dir, "store"))
    shape = MeshShape(dp_shard=dp_shard, ep=2)
    model = parallelize(moe(), shape, build_mesh(shape, "cpu"))
    out, value = loss(model, shape.dp_rank(rank))
    value.backward()
    grads = {n: cases._full(p.grad) for n, p in model.named_parameters()}
    held = {n: p.to_local().shape[0] for n, p in model.named_parameters() if ".experts." in n}
    torch.save({"out": out, "grads": grads, "held": held}, Path(out_dir) / f"ep_rank{rank}.pt")
    dist.destroy_process_group()


def check_ep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dp_shard: int) -> None:
    """Outputs per rank and whole gradients at ep=2 x `dp_shard` equal one process's on the global batch
    (the data-parallel ranks' losses averaged)."""
    world = 2 * dp_shard
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(ep_worker, args=(world, str(tmp_path), dp_shard), nprocs=world, join=True)
    ref = moe()
    outs = []
    for r in range(world):
        out, value = loss(ref, r)
        (value / world).backward()
        outs.append(out)
    for r in range(world):
        got = torch.load(tmp_path / f"ep_rank{r}.pt", weights_only=True)
        torch.testing.assert_close(got["out"], outs[r], atol=EP_TOL, rtol=0)
        # each rank holds 2 of the 4 experts (dim 0 of each stacked weight), and with FSDP half of those
        assert set(got["held"].values()) == {2 // dp_shard} and len(got["held"]) == 6
        assert got["grads"].keys() == dict(ref.named_parameters()).keys()
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got["grads"][n], p.grad, atol=EP_TOL, rtol=0, msg=n)


@pytest.mark.slow  # two spawned processes, 39 s on 2 loaded cores
def test_ep2_matches_one_process_outputs_and_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_ep(tmp_path, monkeypatch, dp_shard=1)


@pytest.mark.slow  # four spawned processes, 70 s on 2 loaded cores
def test_ep2_x_fsdp2_matches_one_process_outputs_and_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_ep(tmp_path, monkeypatch, dp_shard=2)
