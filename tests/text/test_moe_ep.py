"""Expert parallelism of the MoE decoder (`trainer.ep`, core/distributed/expert_parallel.py, text/moe.py) in
real gloo processes: the model laid out by the parallelize stage at ep=2 computes one process's outputs and
gradients, balancing loss included (reference: the same seeded model in this process, unsharded, float64); a
run saved at ep=2 resumes bit-exact; an `ep` that does not split the experts is one line and exit 2; the
dry run lays an MoE out over 64 fake ranks (ep=8 x fsdp=8) with its all-to-alls counted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from core.distributed import MeshShape, build_mesh, mesh_shape
from core.distributed.dry_run import dry_run
from core.distributed.parallelize import parallelize
from tests.helpers import launched_losses, run_here
from tests.text import parallel_cases as cases
from text.llama import DecoderConfig, Llama
from text.moe import router_balance

# float64; EP moves rows between ranks and FSDP averages gradients: only the sums' order changes. Measured
# worst (torch 2.14, CPU): outputs 0, gradients 4e-17 at ep=2 and 2e-15 at ep=2 x fsdp=2
EP_TOL = 1e-10
ROWS = 2  # per data-parallel rank


def moe(experts: int = 4) -> Llama:
    """A random three-block MoE decoder in float64 (the middle block dense), `experts` experts, 2 a token."""
    sizes = {"vocab_size": cases.VOCAB, "context": cases.LEN, "n_layer": 3, "n_head": 4, "n_kv_head": 2}
    sizes |= {"d_model": 32, "hidden": 48, "n_experts": experts, "experts_per_token": 2, "expert_hidden": 16}
    torch.manual_seed(5)
    return Llama(DecoderConfig(**sizes, dense_layers=(1,), router_aux_loss_coef=0.1)).double()


def loss(model: torch.nn.Module, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs, loss) of data-parallel rank `rank`'s rows: a fixed random cotangent, plus the balancing
    loss."""
    out = model(cases.tokens(4 * ROWS, 30)[rank * ROWS : (rank + 1) * ROWS])  # up to 4 ranks
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank), dtype=out.dtype)
    return out.detach(), (out * cotangent).sum() + router_balance(model).loss


def ep_worker(rank: int, world: int, out_dir: str, dp_shard: int, experts: int) -> None:
    """The MoE decoder through `parallelize` at ep=2 (x `dp_shard`): this rank's outputs and the whole
    gradients, saved per rank."""
    import torch.distributed as dist

    cases._start(rank, world, os.path.join(out_dir, "store"))
    shape = MeshShape(dp_shard=dp_shard, ep=2)
    model = parallelize(moe(experts), shape, build_mesh(shape, "cpu"))
    out, value = loss(model, shape.dp_rank(rank))
    value.backward()
    grads = {n: cases._full(p.grad) for n, p in model.named_parameters()}
    held = {n: p.to_local().numel() for n, p in model.named_parameters() if ".experts." in n}
    torch.save({"out": out, "grads": grads, "held": held}, Path(out_dir) / f"ep_rank{rank}.pt")
    dist.destroy_process_group()


def check_ep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dp_shard: int, experts: int = 4) -> None:
    """Outputs per rank and whole gradients at ep=2 x `dp_shard` equal one process's on the global batch
    (the data-parallel ranks' losses averaged)."""
    world = 2 * dp_shard
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(ep_worker, args=(world, str(tmp_path), dp_shard, experts), nprocs=world, join=True)
    ref = moe(experts)
    outs = []
    for r in range(world):
        out, value = loss(ref, r)
        (value / world).backward()
        outs.append(out)
    for r in range(world):
        got = torch.load(tmp_path / f"ep_rank{r}.pt", weights_only=True)
        torch.testing.assert_close(got["out"], outs[r], atol=EP_TOL, rtol=0)
        # each rank holds 2 of the 4 experts (dim 0 of each stacked weight), and with FSDP half of those
        assert got["grads"].keys() == dict(ref.named_parameters()).keys()
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got["grads"][n], p.grad, atol=EP_TOL, rtol=0, msg=n)
    # the ranks' shares of each expert weight are disjoint and whole: every rank holds a world-th of it
    held = [torch.load(tmp_path / f"ep_rank{r}.pt", weights_only=True)["held"] for r in range(world)]
    experts_params = {n: p.numel() for n, p in ref.named_parameters() if ".experts." in n}
    assert len(experts_params) == 6 and all(
        h == {n: k // world for n, k in experts_params.items()} for h in held
    )


@pytest.mark.slow  # two spawned processes, 39 s on 2 loaded cores
def test_ep2_matches_one_process_outputs_and_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_ep(tmp_path, monkeypatch, dp_shard=1)


@pytest.mark.slow  # four spawned processes, 70 s each on 2 loaded cores
# 4 experts: 2 per ep rank, split by expert within (Shard(0)); 2: 1 per ep rank, split by its rows (Shard(1))
@pytest.mark.parametrize("experts", [4, 2])
def test_ep2_x_fsdp2_matches_one_process_outputs_and_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, experts: int
) -> None:
    check_ep(tmp_path, monkeypatch, dp_shard=2, experts=experts)


#: a tiny qwen3_moe run of the lm recipe (8 experts, 2 per token) on 2 ranks at ep=2
RUN = [
    "+task=lm",
    "model=qwen3_moe",
    "trainer=smoke",
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=2",
]
RUN += ["model.n_kv_head=1", "task.context=32", "task.val_chunks=4", "trainer.batch_size=4", "precision=fp32"]
RUN += ["compile.policy=off", "logger=none", "trainer.parallel=fsdp", "trainer.ep=2", "dist.nproc_per_node=2"]
RUN += ["trainer.max_steps=6", "trainer.ckpt_every=3", "trainer.keep_last=5"]


@pytest.mark.slow  # two 2-rank launches, 78 s together on 2 loaded cores
def test_a_run_saved_at_ep2_resumes_bit_exact(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    straight = launched_losses(tmp_path / "straight", RUN)
    ckpt = tmp_path / "straight" / "checkpoints" / "step_00000003"
    assert json.loads((ckpt / "meta.json").read_text())["parallel"]["ep"] == 2
    resumed = launched_losses(tmp_path / "resumed", [*RUN, f"resume={ckpt}"])
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == straight[s] for s in resumed)
    want, got = (
        load_file(tmp_path / "straight" / "model.safetensors"),
        load_file(tmp_path / "resumed" / "model.safetensors"),
    )
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(
    "args",
    [
        ["model=qwen3_moe", "trainer.ep=3"],  # 8 experts do not split 3 ways
        ["model=llama", "trainer.ep=2"],  # a dense decoder has no experts to split
    ],
)
def test_an_ep_that_does_not_split_the_experts_is_one_line_and_exit_2(
    tmp_path: Path, args: list[str]
) -> None:
    # 6 ranks: ep=3 divides them, so the experts are what refuses; nothing is launched or built
    argv = ["+task=lm", *args, "trainer.parallel=fsdp", "dist.nproc_per_node=6", "trainer.batch_size=6"]
    proc = run_here("recipes.train", *argv, f"hydra.run.dir={tmp_path / 'run'}")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and args[1] in err[0]
    assert not (tmp_path / "run").exists()


def test_more_experts_per_token_than_experts_is_one_line_and_exit_2_before_the_device_plan(
    tmp_path: Path,
) -> None:
    argv = ["+task=lm", "model=qwen3_moe", "model.experts_per_token=9", "trainer=smoke"]
    proc = run_here("recipes.train", *argv, f"hydra.run.dir={tmp_path / 'run'}")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "model.experts_per_token=9" in err[0]
    assert "device plan" not in proc.stdout + proc.stderr and not (tmp_path / "run").exists()


def test_the_experts_split_only_where_ep_divides_them() -> None:
    from core.errors import ConfigError
    from tests.helpers import fault

    with pytest.raises(ConfigError) as err:
        mesh_shape("ddp", 4, ep=2)  # the experts' FSDP over the other ranks: a sharded style
    assert fault(err.value)[:2] == ("trainer.ep", "2")
    assert mesh_shape("fsdp", 64, ep=8) == MeshShape(dp_shard=8, ep=8)
    assert MeshShape(dp_shard=2).layout() == {"dp_replicate": 1, "dp_shard": 2, "tp": 1}  # as before ep
    with pytest.raises(ConfigError) as err:
        dry_run(lambda: moe().float(), mesh_shape("fsdp", 6, ep=3))  # 4 experts over 3 ranks
    assert fault(err.value) == ("trainer.ep", "3", ("a divisor of 4",))


def test_a_dry_run_over_64_ranks_splits_the_experts_8_ways_and_counts_the_all_to_alls() -> None:
    def build() -> Llama:
        sizes = {"vocab_size": 64, "context": 16, "n_layer": 2, "n_head": 4, "d_model": 32, "hidden": 48}
        return Llama(DecoderConfig(**sizes, n_experts=8, experts_per_token=2, expert_hidden=32))

    def step(model: torch.nn.Module) -> torch.Tensor:
        return model(torch.zeros(1, 16, dtype=torch.long)).float().square().mean()

    report = dry_run(build, MeshShape(dp_shard=8, ep=8), step=step)
    whole = build()
    experts = sum(p.numel() * 4 for n, p in whole.named_parameters() if ".experts." in n)
    rest = sum(p.numel() * 4 for n, p in whole.named_parameters() if ".experts." not in n)
    # the experts split 64 ways (8 by expert, FSDP 8 ways within), the rest 64 ways by FSDP (rows padded)
    assert experts / 64 + rest / 64 <= report.param_bytes <= experts / 64 + rest / 8
    # per MoE layer: the counts exchanged once, the rows out and back forward and again backward
    assert report.collectives["alltoall"] == 2 and report.collectives["all_to_all_single"] == 4 * 2


def test_qwen3_30b_a3b_over_64_ranks_leaves_rank_0_a_64th_of_its_parameters() -> None:
    # laid out on the meta device (no step): the 30.5 G parameters need no memory, 1.3 s here
    from core.registry import MODELS

    def build() -> Llama:
        return MODELS.build("qwen3_moe_30b_a3b", vocab_size=151_936, context=4096)

    report = dry_run(build, MeshShape(dp_shard=8, ep=8))
    # 16 of the 128 experts per layer on each ep rank, 2 of those per FSDP rank; the rest 64 ways: exactly
    assert report.param_bytes == 30_532_122_624 * 4 // 64
