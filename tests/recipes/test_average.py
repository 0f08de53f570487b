"""`trainer.export=ema` and `python -m recipes.average`: the averaged weights a finished run writes to
model.safetensors, which `recipes.eval` scores as the loop did; bad input is one line, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core import checkpoint
from recipes.average import main
from tests.helpers import DIGITS, train, val_row

#: 5 digits steps, checkpoints at 2, 4 and 5 (all kept), an EMA of the weights exported at the end
EMA_RUN = [
    *(o for o in DIGITS if not o.startswith("trainer.export=")),
    "trainer.ckpt_every=2",
    "trainer.keep_last=0",
    "trainer.ema_decay=0.9",
    "trainer.export=ema",
]


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The finished run (its model.safetensors: the EMA at step 5)."""
    return train(tmp_path_factory.mktemp("ema") / "run", EMA_RUN)


def test_export_ema_writes_the_ema_which_eval_scores_as_the_loop_did(ema_run: Path, cli_here) -> None:
    exported = load_file(ema_run / "model.safetensors")
    kept = checkpoint.load(ema_run / "checkpoints" / "step_00000005")[1]["callbacks"]["EMA"]
    assert exported.keys() == {k for k in kept if k != "n_averaged"}
    assert all(torch.equal(exported[k], kept[k]) for k in exported)
    assert json.loads((ema_run / "result.json").read_text())["exported"] == "last step's EMA"
    r = cli_here(f"ckpt={ema_run}", module="recipes.eval")
    assert r.returncode == 0, r.stderr[-2000:]
    logged = {k.replace("val/ema_", "val/"): v for k, v in val_row(ema_run, 5).items() if "/ema_" in k}
    assert json.loads(r.stdout)["metrics"] == logged  # ==: the same weights, plan, batches and order


def test_average_of_the_last_checkpoints_is_written_and_scored(
    ema_run: Path, cli_here, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(ema_run, run)  # the module's run stays as trained
    exported = (run / "model.safetensors").read_bytes()
    r = cli_here(f"ckpt={run}", "last=2", module="recipes.average")
    assert r.returncode == 0, r.stderr[-2000:]
    line = json.loads(r.stdout)
    steps = [run / "checkpoints" / f"step_{s:08d}" for s in (4, 5)]
    kept = run / "model.exported.safetensors"
    assert line == {
        "averaged": [str(p) for p in steps],
        "written": str(run / "model.safetensors"),
        "export_kept": str(kept),
    }
    assert kept.read_bytes() == exported  # the run's own export, moved aside, not lost
    avg = load_file(run / "model.safetensors")
    a, b = (checkpoint.load(p)[0] for p in steps)
    for k, v in avg.items():
        if v.is_floating_point():  # the float64 mean rounded once to float32
            torch.testing.assert_close(v, ((a[k].double() + b[k].double()) / 2).float(), rtol=0, atol=0)
        else:
            assert torch.equal(v, b[k])  # counters: the newest checkpoint's
    r = cli_here(f"ckpt={run}", module="recipes.eval")
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["weights"] == str(run / "model.safetensors") and 0 <= result["metrics"]["val/accuracy"] <= 1
    # out= writes elsewhere and leaves the run's file
    assert main([f"ckpt={run}", "last=3", f"out={tmp_path / 'avg3.safetensors'}"]) == 0
    assert load_file(tmp_path / "avg3.safetensors").keys() == avg.keys()
    # a second average into the run keeps the first backup: the run's own export
    assert main([f"ckpt={run}", "last=3"]) == 0
    assert kept.read_bytes() == exported


def test_bad_average_input_is_one_line_exit_2(
    ema_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv, key in (
        ([f"ckpt={ema_run}", "last=4"], "last=4"),  # 3 checkpoints kept
        ([f"ckpt={empty}", "last=1"], f"ckpt={empty}"),  # a run with none
        ([f"ckpt={ema_run}", "last=0"], "last=0"),
        ([f"ckpt={ema_run}", "every=2"], "unknown key 'every'"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"error: {key}"), err
