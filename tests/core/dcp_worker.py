"""One rank of a real multi-process gloo run for tests/core/test_distributed_checkpoint.py.

`python tests/core/dcp_worker.py SCENARIO OUT_DIR` with RANK, WORLD_SIZE and TK_STORE (a FileStore path) set;
each scenario writes what the test compares into OUT_DIR. The model and data helpers are imported by the test
too, so both sides build the same MLP and the same batches.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.distributed.group import exit_process  # noqa: E402
from core.rng import rng_state, set_rng_state  # noqa: E402

STEPS = 4  # the uninterrupted run's length
SAVE_AT = 2  # the step the resumed run starts from


def make_mlp() -> nn.Sequential:
    """The tiny model every scenario trains; the same weights on every rank (seed 0), dropout to use RNG."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 4))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    """One AdamW step on a batch fixed by (step, rank)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of every scenario."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def fsdp_mlp() -> nn.Module:
    """The MLP with FSDP2: each Linear its own unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    model = make_mlp()
    for layer in (model[0], model[3]):
        fully_shard(layer)
    return fully_shard(model)


def full_optim_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The optimizer state by parameter name, gathered to full tensors on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, opt, options=options)


def _dump(out: Path, name: str, model: nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
    from core.checkpoint import full_model_state

    weights = full_model_state(model)
    optim = full_optim_state(model, opt) if opt is not None else None
    if int(os.environ["RANK"]) == 0:
        torch.save({"model": weights, "optim": optim}, out / f"{name}.pt")
    else:
        assert weights == {}, "full_model_state gathers on rank 0 only"


def scenario_train(out: Path, rank: int) -> None:
    """2-rank FSDP run of STEPS steps, checkpointed at SAVE_AT (blocking and async), then a TP=2 run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from core.checkpoint import save_sharded

    model = fsdp_mlp()
    opt = adamw(model)
    torch.manual_seed(100 + rank)  # dropout masks differ per rank, so per-rank RNG state matters
    for step in range(1, STEPS + 1):
        train_step(model, opt, step, rank)
        if step == SAVE_AT:
            train = {"rng": rng_state(), "step": step}
            parts = {"model": model, "optimizer": opt, "train": train, "meta": {"epoch": 0}}
            save_sharded(out / "fsdp", step, **parts)
            pending = save_sharded(out / "fsdp_async", step, **parts, async_save=True)
            pending.result()
            _dump(out, "fsdp_at_save", model, opt)
    _dump(out, "fsdp_final", model)

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    tp = parallelize_module(make_mlp(), mesh, {"0": ColwiseParallel(), "3": RowwiseParallel()})
    tp_opt = adamw(tp)
    train_step(tp, tp_opt, 1, 0)  # tensor-parallel peers see the same batch
    save_sharded(out / "tp", 1, model=tp, optimizer=tp_opt, train={"step": 1}, meta={})
    _dump(out, "tp_at_save", tp)


def scenario_resume(out: Path, rank: int) -> None:
    """2 ranks: resume the FSDP checkpoint and finish; load 1-process checkpoints into FSDP; TP -> DDP."""
    from torch.nn.parallel import DistributedDataParallel

    from core.checkpoint import load_into

    model = fsdp_mlp()
    opt = adamw(model)
    torch.manual_seed(12345)  # whatever the fresh process holds, the checkpoint's RNG state replaces it
    train, _ = load_into(out / "fsdp" / f"step_{SAVE_AT:08d}", model=model, optimizer=opt)
    set_rng_state(train["rng"])
    for step in range(train["step"] + 1, STEPS + 1):
        train_step(model, opt, step, rank)
    _dump(out, "resumed_final", model)

    for name in ("single_legacy", "single_dcp"):
        model = fsdp_mlp()
        opt = adamw(model)
        train, meta = load_into(out / name / "step_00000003", model=model, optimizer=opt)
        _dump(out, f"{name}_as_fsdp", model, opt)
        (out / f"{name}_as_fsdp_rank{rank}.json").write_text(
            json.dumps({"step": train["step"], "rank_state_from": meta["rank_state_from"]})
        )

    ddp = DistributedDataParallel(make_mlp())
    load_into(out / "tp" / "step_00000001", model=ddp, optimizer=adamw(ddp))
    if rank == 0:
        torch.save({"model": ddp.module.state_dict()}, out / "tp_as_ddp.pt")


def scenario_fail(out: Path, rank: int) -> None:
    """2 ranks: a good save; a save whose rank 1 fails after its shards (ENOSPC); a save where rank 0 is
    SIGKILLed right before the rename."""
    from core.checkpoint import sharded
    from core.errors import CheckpointWriteError

    model = fsdp_mlp()
    opt = adamw(model)
    root = out / "ckpts"
    real_fsync = sharded.fsync
    for step in (1, 2, 3):
        train_step(model, opt, step, rank)
        if step == 2 and rank == 1:  # fsync of the train file: after DCP has written this rank's shards

            def full_disk(path: Path) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            sharded.fsync = full_disk
        if step == 3 and rank == 0:

            def killed_before_rename(src: object, dst: object) -> None:
                os.kill(os.getpid(), signal.SIGKILL)

            sharded.os.replace = killed_before_rename
        try:
            sharded.save(root, step, model=model, optimizer=opt, train={"step": step}, meta={})
        except CheckpointWriteError as e:
            (out / f"error_rank{rank}.json").write_text(json.dumps({"message": str(e), "exit": e.exit_code}))
        sharded.fsync = real_fsync


def main() -> None:
    """Join the gloo group, run the scenario, leave."""
    import torch.distributed as dist

    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.environ['TK_STORE']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        globals()[f"scenario_{scenario}"](out, rank)
    except BaseException:
        dist.destroy_process_group()
        raise
    # meet before tearing down: a rank that leaves first closes connections a peer's gloo threads still
    # use, and that peer aborts ("terminate called without an active exception", seen under load)
    dist.barrier()
    dist.destroy_process_group()
    # and end as the trainer's ranks do (core.distributed.group.exit_process says why): the checkpoint's own
    # gloo group and writer thread, still referenced at interpreter teardown, aborted rank 0 after a
    # passing run (exit -6, seen twice under load)
    exit_process(0)


if __name__ == "__main__":
    main()
