"""core.checkpoint: atomic writes, completeness, pruning, resolution and clear failures; and
core.loop.checkpointer, which saves and resumes a run from the parts it is handed."""

from __future__ import annotations

import ast
import errno
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from core import checkpoint
from core.distributed import DistEnv
from core.errors import CheckpointError, CheckpointWriteError
from core.loop.callbacks import EarlyStopConfig, EarlyStopping
from core.loop.checkpointer import Checkpointer, CheckpointParts, TrainState
from core.loop.config import TrainerConfig
from tests.helpers import fault, in_small_filesystem


def _save(root: Path, step: int, keep_last: int = 2) -> Path:
    return checkpoint.save(
        root,
        step,
        model={"_orig_mod.w": torch.full((2,), float(step))},
        train={"step": step},
        meta={"epoch": 1},
        keep_last=keep_last,
    )


def _parts(seed: int, saved: list[Path]) -> CheckpointParts:
    """A model, optimizer, schedule, scaler and one stateful callback, built without any trainer."""
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    stopper = EarlyStopping(EarlyStopConfig(patience=3))
    return CheckpointParts(
        model=model,
        optimizer=opt,
        scheduler=sched,
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        callbacks=[("EarlyStopping", stopper)],
        ema=None,
        dist=DistEnv(),
        layout={},
        task="Toy",
        precision="fp32",
        compiled=False,
        compile_cfg=None,
        say=lambda line: None,
        warn=lambda line: None,
        on_saved=saved.append,
    )


def test_the_checkpointer_saves_and_resumes_from_the_parts_it_is_handed(tmp_path: Path) -> None:
    saved: list[Path] = []
    parts = _parts(0, saved)
    parts.callbacks[0][1].bad_evals = 2  # a callback's state, which the checkpoint keeps
    parts.scheduler.step()  # one step further than a fresh schedule
    settings = {"run_dir": tmp_path, "monitor": "val/loss", "monitor_max": False}
    state = TrainState(step=4, epoch=1, batch_in_epoch=1, best=0.5, last_eval={"val/loss": 0.5}, best_step=4)
    Checkpointer(parts, TrainerConfig(), resume=None, **settings).save(state, evaluated=True, next_batch=2)
    assert [p.name for p in saved] == ["step_00000004"]
    meta = json.loads((saved[0] / "meta.json").read_text())
    assert meta["monitor"] == {"key": "val/loss", "value": 0.5} and meta["task"] == "Toy"
    fresh = _parts(1, [])
    loaded = Checkpointer(fresh, TrainerConfig(), resume="auto", **settings).load()
    assert loaded == TrainState(4, 1, 2, 0.5, {"val/loss": 0.5}, 4, "")  # resumes at the next batch
    assert fresh.callbacks[0][1].bad_evals == 2
    assert fresh.scheduler.state_dict() == parts.scheduler.state_dict()
    for k, v in parts.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[k], v), k
    moments = fresh.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(moments, parts.optimizer.state_dict()["state"][0]["exp_avg"])
    assert Checkpointer(_parts(2, []), TrainerConfig(), resume=None, **settings).load() is None


def test_save_load_roundtrip_strips_compile_prefix(tmp_path: Path) -> None:
    path = _save(tmp_path, 7)
    assert path.name == "step_00000007"
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "model.pt", "train.pt"]
    model, train, meta = checkpoint.load(path)
    assert list(model) == ["w"] and torch.equal(model["w"], torch.full((2,), 7.0))
    assert train == {"step": 7} and meta["step"] == 7 and meta["epoch"] == 1


def test_prunes_to_keep_last_and_ignores_half_written(tmp_path: Path) -> None:
    for s in (1, 2, 3):
        _save(tmp_path, s)
    (tmp_path / ".tmp-step_00000009-1").mkdir()  # a crash mid-write
    (tmp_path / "step_00000010").mkdir()  # renamed dir without meta.json is not complete
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert checkpoint.resolve("auto", tmp_path.parent / "nothing") is None


def test_resolve_run_dir_and_errors(tmp_path: Path) -> None:
    _save(tmp_path / "run" / "checkpoints", 4)
    assert checkpoint.resolve("auto", tmp_path / "run").name == "step_00000004"
    assert checkpoint.resolve(str(tmp_path / "run"), tmp_path).name == "step_00000004"
    with pytest.raises(CheckpointError) as e:
        checkpoint.resolve(str(tmp_path / "nope"), tmp_path)
    assert fault(e.value)[:2] == ("resume", str(tmp_path / "nope"))


def test_disk_full_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 1)

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(CheckpointWriteError) as e:
        _save(tmp_path, 2)
    assert fault(e.value) == ("checkpoint", str(tmp_path / "step_00000002"), ())
    assert e.value.__context__.errno == errno.ENOSPC  # the disk's own error, kept as the context
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]  # no tmp dir left behind
    model, _, _ = checkpoint.load(tmp_path / "step_00000001")
    assert torch.equal(model["w"], torch.ones(2))


def test_mismatched_model_is_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as e:
        checkpoint.load_model_state(nn.Linear(3, 3), {"weight": torch.zeros(2, 2)}, tmp_path)
    assert fault(e.value)[:2] == ("checkpoint", str(tmp_path)) and "\n" not in str(e.value)


def test_loading_refuses_pickled_code(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    torch.save({"evil": nn.Linear(1, 1)}, path / "train.pt")  # a module is not a plain tensor/container
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(path)
    assert fault(e.value)[:2] == ("checkpoint", str(path))


ROOT = Path(__file__).resolve().parents[2]


FILL = textwrap.dedent(
    """
    import json, os, torch
    from pathlib import Path
    from core import checkpoint
    from core.errors import CheckpointWriteError
    root = Path(os.environ["MOUNTED"]) / "ckpt"
    checkpoint.save(root, 1, model={"w": torch.ones(1000)}, train={"step": 1}, meta={})
    try:  # 8 MB into a 512 KiB filesystem: torch's writer fails with a RuntimeError, not an OSError
        checkpoint.save(root, 2, model={"w": torch.ones(2_000_000)}, train={"step": 2}, meta={})
    except CheckpointWriteError as e:
        error = str(e)
    model, train, _ = checkpoint.load(root / "step_00000001")
    print(json.dumps({"error": error, "left": sorted(p.name for p in root.iterdir()),
                      "w": float(model["w"].sum()), "step": train["step"]}))
    """
)


def test_a_real_full_filesystem_is_one_line_and_keeps_the_earlier_checkpoint(tmp_path: Path) -> None:
    proc = in_small_filesystem("512k", sys.executable, "-c", FILL, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"].startswith("could not write checkpoint ") and "\n" not in out["error"]
    assert f": {os.strerror(errno.ENOSPC)}; " in out["error"], out["error"]  # the OS's words, not torch's
    assert re.search(r"; \d+ bytes free there; earlier checkpoints are intact", out["error"]), out["error"]
    assert out["left"] == ["step_00000001"] and out["w"] == 1000.0 and out["step"] == 1  # no .tmp-* left


def test_a_recipe_on_a_full_disk_stops_with_one_line_and_exit_74(tmp_path: Path) -> None:
    # the default digits CNN checkpoints ~0.8 MB; its config, metrics and event files fit in 256 KiB
    run = tmp_path / "fs" / "run"
    cmd = [sys.executable, "-m", "recipes.train", "+task=image_classification", "trainer.max_epochs=1"]
    proc = in_small_filesystem(
        "256k", *cmd, "trainer.progress=false", f"hydra.run.dir={run}", tmp_path=tmp_path
    )
    assert proc.returncode == 74, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: could not write checkpoint ") and "Traceback" not in proc.stderr


@pytest.mark.slow  # the warn variant of the full-disk stop above, which the default suite keeps
def test_with_ckpt_on_error_warn_a_full_disk_warns_then_the_export_is_one_line(tmp_path: Path) -> None:
    # checkpoints fail and are warned about; the final model.safetensors (safetensors' own error) is one line
    run = tmp_path / "fs" / "run"
    cmd = [sys.executable, "-m", "recipes.train", "+task=image_classification", "trainer.max_epochs=1"]
    cmd += ["trainer.progress=false", "trainer.ckpt_on_error=warn", f"hydra.run.dir={run}"]
    proc = in_small_filesystem("256k", *cmd, tmp_path=tmp_path)
    assert proc.returncode == 74, proc.stderr[-2000:]
    assert "training on (trainer.ckpt_on_error=warn)" in proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith(f"error: could not write {run}/model.safetensors: ")
        and "Traceback" not in proc.stderr
    )


PACKAGE = ROOT / "core" / "checkpoint"
#: what each module of the package may import from core: the top calls down into the formats, the formats
#: into the shared layout and weights, never back up (and nothing here knows the trainer)
ALLOWED = {
    "layout": {"core.errors", "core.files"},
    "weights": {"core.errors"},
    "single": {"core.checkpoint.layout", "core.checkpoint.weights", "core.errors", "core.files"},
    "sharded": {"core.checkpoint.layout", "core.checkpoint.weights", "core.errors", "core.files"},
}


def _core_imports(file: Path) -> set[str]:
    """The `core.*` modules `file` imports, at any depth (`from core.checkpoint import layout` counts as
    core.checkpoint.layout)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "core")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "core":
            if node.module == "core.checkpoint":
                found.update(f"core.checkpoint.{a.name}" for a in node.names)
            else:
                found.add(node.module)
    return found


def test_the_checkpoint_package_imports_one_way() -> None:
    modules = {f.stem for f in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules == set(ALLOWED)
    for name, allowed in ALLOWED.items():
        assert _core_imports(PACKAGE / f"{name}.py") <= allowed, name
    top = _core_imports(PACKAGE / "__init__.py")
    assert all(m.startswith("core.checkpoint.") or m in ("core.errors", "core.files") for m in top), top
    # importing the package loads neither DCP (until a sharded checkpoint is written or read) nor the loop
    watched = "{'torch.distributed.checkpoint', 'core.loop.trainer'}"
    code = f"import sys, core.checkpoint; print(sorted({watched} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-2000:]


@pytest.mark.gpu
def test_cuda_state_saves_and_loads_back_exactly(tmp_path: Path) -> None:
    # CUDA weights and the CUDA generator's state: written from the device, read back to CPU (as resume and
    # export read them), then loaded into a model on the device
    torch.manual_seed(0)
    model = nn.Linear(5, 3).cuda()
    rng = torch.cuda.get_rng_state()
    path = checkpoint.save(
        tmp_path, 4, model={f"_orig_mod.{k}": v for k, v in model.state_dict().items()},
        train={"cuda_rng": rng}, meta={}, keep_last=1,
    )  # fmt: skip
    state, train, _ = checkpoint.load(path)
    assert all(not v.is_cuda for v in state.values()) and torch.equal(train["cuda_rng"], rng)
    fresh = nn.Linear(5, 3).cuda()
    checkpoint.load_model_state(fresh, state, path)
    for k, v in model.state_dict().items():
        assert fresh.state_dict()[k].is_cuda and torch.equal(fresh.state_dict()[k], v), k
