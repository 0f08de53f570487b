"""core.checkpoint: atomic writes, completeness, pruning, resolution and clear failures."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from torch import nn

from core import checkpoint
from core.errors import CheckpointError


def _save(root: Path, step: int, keep_last: int = 2) -> Path:
    return checkpoint.save(
        root,
        step,
        model={"_orig_mod.w": torch.full((2,), float(step))},
        train={"step": step},
        meta={"epoch": 1},
        keep_last=keep_last,
    )


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
    with pytest.raises(CheckpointError, match=r"resume=.*nope: no complete checkpoint"):
        checkpoint.resolve(str(tmp_path / "nope"), tmp_path)


def test_disk_full_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 1)

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(CheckpointError, match="No space left on device; earlier checkpoints are intact"):
        _save(tmp_path, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]  # no tmp dir left behind
    model, _, _ = checkpoint.load(tmp_path / "step_00000001")
    assert torch.equal(model["w"], torch.ones(2))


def test_mismatched_model_is_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"does not match the model") as e:
        checkpoint.load_model_state(nn.Linear(3, 3), {"weight": torch.zeros(2, 2)}, tmp_path)
    assert "\n" not in str(e.value)


def test_loading_refuses_pickled_code(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    torch.save({"evil": nn.Linear(1, 1)}, path / "train.pt")  # a module is not a plain tensor/container
    with pytest.raises(CheckpointError, match="holds objects other than tensors"):
        checkpoint.load(path)
