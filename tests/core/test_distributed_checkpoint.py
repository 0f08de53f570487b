"""core.checkpoint.sharded: sharded checkpoints written and read by real gloo processes on CPU.

Ranks are separate Python processes (tests/core/dcp_worker.py) that meet through a FileStore, as torchrun's
workers would; every comparison is exact (`torch.equal`): resharding moves bytes, it does no arithmetic.
The default run launches two 2-process runs (train, and the failure/kill run); the tests that need a third
(resume: same-layout bit-exact, 1 process -> FSDP, TP -> DDP) are marked slow.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from core import checkpoint
from core.checkpoint import load_into, save_sharded
from core.errors import CheckpointError
from core.rng import rng_state
from tests.core import dcp_worker
from tests.core.dcp_worker import SAVE_AT, adamw, make_mlp, train_step
from tests.helpers import fault

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(dcp_worker.__file__)


def _launch(scenario: str, out: Path, world: int = 2, timeout: float = 240) -> list[int]:
    """Run `scenario` as `world` processes; returns their exit codes. Like torchrun's agent, once one rank
    dies the others get a short grace period, then are killed."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(world)}
    env["TK_STORE"] = str(out / f"store-{scenario}")
    procs = []
    for rank in range(world):
        log = (out / f"{scenario}-rank{rank}.log").open("w")
        cmd = [sys.executable, str(WORKER), scenario, str(out)]
        procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(rank)}, stdout=log, stderr=log))
    deadline, first_death = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if first_death is None and any(p.poll() not in (None, 0) for p in procs):
            first_death = now
        if now > deadline or (first_death is not None and now - first_death > 30):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    return [p.returncode for p in procs]


def _log(out: Path, scenario: str) -> str:
    return "\n".join((out / f"{scenario}-rank{r}.log").read_text() for r in range(2))


def _assert_equal_states(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _single_process_checkpoints(out: Path) -> dict:
    """One process trains 3 steps and writes both formats: `core.checkpoint.save` (model.pt/train.pt, from
    before sharding) and `save_sharded` without a process group; returns its full state."""
    model = make_mlp()
    opt = adamw(model)
    for step in (1, 2, 3):
        train_step(model, opt, step, 0)
    train = {"rng": rng_state(), "step": 3}
    checkpoint.save(
        out / "single_legacy",
        3,
        model=model.state_dict(),
        train={**train, "optimizer": opt.state_dict()},
        meta={},
    )
    save_sharded(out / "single_dcp", 3, model=model, optimizer=opt, train=train, meta={})
    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": optim_state}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank FSDP run checkpointed at SAVE_AT (blocking and async), a TP=2 checkpoint, and two
    single-process checkpoints."""
    out = tmp_path_factory.mktemp("dcp")
    assert _launch("train", out) == [0, 0], _log(out, "train")
    torch.save(_single_process_checkpoints(out), out / "single.pt")
    return out


@pytest.fixture(scope="module")
def resumed(trained: Path) -> Path:
    """A second 2-rank launch: resume the FSDP checkpoint, load the single-process ones, load TP as DDP."""
    assert _launch("resume", trained) == [0, 0], _log(trained, "resume")
    return trained


def _saved(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)


@pytest.mark.slow  # the second 2-process launch (the `resumed` fixture)
def test_two_rank_fsdp_resume_continues_bit_exact(resumed: Path) -> None:
    """(a) Same layout, same world size: the resumed run's final weights equal the uninterrupted run's."""
    _assert_equal_states(_saved(resumed, "resumed_final")["model"], _saved(resumed, "fsdp_final")["model"])
    # the dropout draws after the save matter: without each rank's RNG state the weights would differ
    meta = json.loads((resumed / "fsdp" / f"step_{SAVE_AT:08d}" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["format"] == "dcp" and meta["placements"] == ["S(0)"]


def test_one_process_loads_a_two_rank_fsdp_checkpoint(trained: Path) -> None:
    """(b) 2 ranks -> 1 process without a process group: full weights and optimizer state equal the 2-rank
    run's gathered ones; its training state is rank 0's."""
    model = make_mlp()
    opt = adamw(model)
    train, meta = load_into(trained / "fsdp" / f"step_{SAVE_AT:08d}", model=model, optimizer=opt)
    want = _saved(trained, "fsdp_at_save")
    _assert_equal_states(model.state_dict(), want["model"])
    got_optim = get_state_dict(model, opt)[1]
    for name, state in want["optim"]["state"].items():
        _assert_equal_states(got_optim["state"][name], state)
    assert train["step"] == SAVE_AT and meta["rank_state_from"] == 0
    # the single-process reader of core.checkpoint sees the same full weights
    weights, train0, _ = checkpoint.load(trained / "fsdp" / f"step_{SAVE_AT:08d}")
    _assert_equal_states(weights, want["model"])
    assert train0["step"] == SAVE_AT


def test_load_sharded_reads_a_pre_sharding_checkpoint_in_one_process(trained: Path) -> None:
    """Without a process group, `load_into` on a model.pt/train.pt checkpoint is the old load: weights,
    the id-keyed optimizer state and the training state come back as they were written."""
    model = make_mlp()
    opt = adamw(model)
    train, meta = load_into(trained / "single_legacy" / "step_00000003", model=model, optimizer=opt)
    want = _saved(trained, "single")
    _assert_equal_states(model.state_dict(), want["model"])
    for name, state in get_state_dict(model, opt)[1]["state"].items():
        _assert_equal_states(state, want["optim"]["state"][name])
    assert train["step"] == 3 and "optimizer" not in train and meta["rank_state_from"] == 0


@pytest.mark.slow  # the second 2-process launch (the `resumed` fixture)
def test_single_process_checkpoints_load_into_two_rank_fsdp(resumed: Path) -> None:
    """(c) 1 process -> 2-rank FSDP, both the pre-sharding format (model.pt/train.pt, id-keyed optimizer) and
    a sharded one: weights and optimizer state equal the writer's."""
    want = _saved(resumed, "single")
    for name in ("single_legacy", "single_dcp"):
        got = _saved(resumed, f"{name}_as_fsdp")
        _assert_equal_states(got["model"], want["model"])
        assert sorted(got["optim"]["state"]) == sorted(want["optim"]["state"])
        for param, state in want["optim"]["state"].items():
            _assert_equal_states(got["optim"]["state"][param], state)
        assert got["optim"]["param_groups"][0]["lr"] == want["optim"]["param_groups"][0]["lr"]
        for rank in (0, 1):  # both ranks restore the one rank's training state there is, and say so
            info = json.loads((resumed / f"{name}_as_fsdp_rank{rank}.json").read_text())
            assert info == {"step": 3, "rank_state_from": 0}


@pytest.mark.slow  # the second 2-process launch (the `resumed` fixture)
def test_a_tensor_parallel_checkpoint_loads_under_ddp(resumed: Path) -> None:
    """(d) TP=2 (Colwise/Rowwise MLP) -> DP=2 (DDP): every rank holds the full weights the TP run had."""
    _assert_equal_states(_saved(resumed, "tp_as_ddp")["model"], _saved(resumed, "tp_at_save")["model"])
    meta = json.loads((resumed / "tp" / "step_00000001" / "meta.json").read_text())
    assert meta["meshes"] == [{"tp": 2}] and meta["placements"] == ["R", "S(0)", "S(1)"]


def test_async_save_writes_what_a_blocking_save_writes(trained: Path) -> None:
    """(g) The same state saved with async_save and blocking: the same files, the same contents."""
    blocking, background = (trained / d / f"step_{SAVE_AT:08d}" for d in ("fsdp", "fsdp_async"))
    names = sorted(p.name for p in blocking.iterdir())
    assert names == sorted(p.name for p in background.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "train.pt"] + [
        "train_rank0.pt",
        "train_rank1.pt",
    ]
    loaded = []
    for path in (blocking, background):
        model = make_mlp()
        opt = adamw(model)
        load_into(path, model=model, optimizer=opt)
        loaded.append(get_state_dict(model, opt))
    _assert_equal_states(loaded[0][0], loaded[1][0])
    for name, state in loaded[0][1]["state"].items():
        _assert_equal_states(loaded[1][1]["state"][name], state)
    for name in ("train_rank0.pt", "train_rank1.pt"):
        a, b = (torch.load(p / name, weights_only=True) for p in (blocking, background))
        assert a["step"] == b["step"] and torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    metas = [json.loads((p / "meta.json").read_text()) for p in (blocking, background)]
    assert metas[0] == metas[1]


def test_a_failed_or_killed_rank_never_leaves_a_checkpoint_resume_picks(tmp_path: Path) -> None:
    """(e) Rank 1 hits ENOSPC after its shards are written: both ranks raise the one-line exit-74 error
    and step 2 leaves nothing. Rank 0 is SIGKILLed right before renaming step 3: only a `.tmp-` dir is left,
    resume still picks step 1, and the next start removes the dead writer's leftovers."""
    codes = _launch("fail", tmp_path)
    assert codes[0] == -signal.SIGKILL, _log(tmp_path, "fail")
    assert codes[1] == 1  # the survivor raised (gloo: connection closed by peer) rather than waiting
    for rank in (0, 1):
        err = json.loads((tmp_path / f"error_rank{rank}.json").read_text())
        assert err["exit"] == 74 and "\n" not in err["message"]
        assert "could not write checkpoint" in err["message"] and "step_00000002" in err["message"]
    assert "No space left on device" in json.loads((tmp_path / "error_rank1.json").read_text())["message"]
    assert "rank 1 could not write" in json.loads((tmp_path / "error_rank0.json").read_text())["message"]

    root = tmp_path / "ckpts"
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step_00000001"]
    assert checkpoint.resolve(str(root), tmp_path).name == "step_00000001"
    leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))
    assert len(leftovers) == 1 and leftovers[0].startswith(".tmp-step_00000003-")
    assert (root / leftovers[0] / ".metadata").is_file()  # the shards were written; only the rename was not
    assert checkpoint.remove_stale_temporaries(root) == 1
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]
    model = make_mlp()
    train, meta = load_into(root / "step_00000001", model=model, optimizer=adamw(model))
    assert train["step"] == 1 and meta["world_size"] == 2


class _Pwn:
    """A pickle payload: unpickling it runs a shell command."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.target}",)


def _one_process_checkpoint(root: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    model = make_mlp()
    opt = adamw(model)
    train_step(model, opt, 1, 0)
    return save_sharded(root, 1, model=model, optimizer=opt, train={"step": 1}, meta={}), model, opt


def test_a_crafted_index_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    """(f) DCP's stock reader unpickles `.metadata` with plain pickle; a `.metadata` whose unpickling would
    run a command is refused in one line by load_into and by core.checkpoint.load, and runs nothing."""
    path, _, _ = _one_process_checkpoint(tmp_path / "ckpts")
    pwned = tmp_path / "PWNED"
    payload = pickle.dumps(_Pwn(pwned))
    pickle.loads(payload)  # the bait is live: plain unpickling runs it
    assert pwned.exists()
    pwned.unlink()
    (path / ".metadata").write_bytes(payload)
    model = make_mlp()
    loads = (lambda: load_into(path, model=model, optimizer=adamw(model)), lambda: checkpoint.load(path))
    for load in loads:
        with pytest.raises(CheckpointError) as e:
            load()
        assert fault(e.value)[:2] == ("checkpoint", str(path)) and "\n" not in str(e.value)
    assert not pwned.exists()


@pytest.mark.filterwarnings("ignore:.*(single process|overwriting):UserWarning")  # the planting dcp.save's
def test_a_crafted_non_tensor_item_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    """(f) DCP's default planner loads non-tensor items (param_groups) with weights_only=False; a checkpoint
    whose learning rate unpickles to a command is refused in one line and runs nothing."""
    path, model, opt = _one_process_checkpoint(tmp_path / "ckpts")
    pwned = tmp_path / "PWNED"
    model_state, optim_state = get_state_dict(model, opt)
    optim_state["param_groups"][0]["lr"] = _Pwn(pwned)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path, no_dist=True)
    fresh = make_mlp()
    with pytest.raises(CheckpointError) as e:
        load_into(path, model=fresh, optimizer=adamw(fresh))
    assert fault(e.value)[:2] == ("checkpoint", str(path))
    assert "\n" not in str(e.value) and not pwned.exists()


def test_an_index_pointing_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    """A well-formed index whose chunks name a file outside the checkpoint dir is refused before reading."""
    path, _, _ = _one_process_checkpoint(tmp_path / "ckpts")
    index = pickle.loads((path / ".metadata").read_bytes())  # our own, trusted file
    for info in index.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    (path / ".metadata").write_bytes(pickle.dumps(index))
    model = make_mlp()
    with pytest.raises(CheckpointError) as e:
        load_into(path, model=model, optimizer=adamw(model))
    assert fault(e.value) == ("checkpoint", "../../elsewhere.distcp", ("a file name beside the index",))


def test_a_checkpoint_of_another_model_is_one_line(tmp_path: Path) -> None:
    """Loading into a model with other shapes names the checkpoint and the mismatch in one line."""
    path, _, _ = _one_process_checkpoint(tmp_path / "ckpts")
    nn = torch.nn
    other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(), nn.Linear(32, 4))
    with pytest.raises(CheckpointError) as e:
        load_into(path, model=other, optimizer=adamw(other))
    assert fault(e.value)[:2] == ("checkpoint", str(path)) and "\n" not in str(e.value)
