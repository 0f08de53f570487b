"""core.data.workers: a DataLoader worker killed by a signal, or raising a typed error, ends the run in one
line
naming the sample (real worker processes, real SIGKILL)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from core.errors import DataError, WorkerDied
from core.optim import OptimConfig
from tests.core.killer_data import KILL_INDEX, KillerPoints
from tests.core.toy_task import NoisyPoints, ToyTask
from tests.helpers import cli_env, toy_trainer


class KillerTask(ToyTask):
    """ToyTask whose training set kills the worker that loads sample KILL_INDEX."""

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        return KillerPoints(self.n, self.jitter), NoisyPoints(12, 0.0)


class RaisingPoints(NoisyPoints):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == KILL_INDEX:
            raise DataError(f"points/{i:04d}.pt: broken (data.on_bad_sample=error)")
        return super().__getitem__(i)


class RaisingTask(ToyTask):
    def build_datasets(self) -> tuple[Dataset, Dataset]:
        return RaisingPoints(self.n, self.jitter), NoisyPoints(12, 0.0)


#: one epoch in a real worker process, AdamW's defaults, seed 0
RUN = {"max_epochs": 1, "num_workers": 1, "optim": OptimConfig(), "seed": 0}


def test_a_worker_killed_by_sigkill_is_one_error_naming_its_sample(tmp_path: Path) -> None:
    with pytest.raises(WorkerDied) as e:
        toy_trainer(tmp_path, task=KillerTask(), **RUN).fit()
    msg = str(e.value)
    assert f"sample {KILL_INDEX} of split 'train' (points/{KILL_INDEX:04d}.pt)" in msg
    assert "\n" not in msg and e.value.exit_code == 70


def test_a_typed_error_raised_in_a_worker_keeps_its_type_and_loses_the_traceback(tmp_path: Path) -> None:
    with pytest.raises(DataError) as e:
        toy_trainer(tmp_path, task=RaisingTask(), **RUN).fit()
    assert str(e.value) == f"points/{KILL_INDEX:04d}.pt: broken (data.on_bad_sample=error)"


def test_the_cli_reports_a_killed_worker_in_one_line_with_exit_70(tmp_path: Path) -> None:
    # the real CLI in a real process, with a registered dataset whose sample 5 SIGKILLs its worker
    run = "import sys, tests.core.killer_data; from recipes.train import main; sys.exit(main(sys.argv[1:]))"
    args = [
        "+task=image_classification",
        "data.name=killer_digits",
        "trainer.num_workers=1",
        "trainer.max_epochs=1",
        "trainer.progress=false",
        "model.width=8",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    r = subprocess.run(
        [sys.executable, "-c", run, *args],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 70, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: a DataLoader worker (pid ") and f"(digits/{KILL_INDEX:04d}.png)" in last
