"""Processes started together (torchrun ranks, sweep jobs) do not race on the files and folders of a start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.load import background

REPO = Path(__file__).resolve().parents[2]

# Each process validates a fresh nested run dir and then creates it and writes in it, as Hydra does next,
# 150 times, starting every round at the same moment (a shared counter file as the barrier).
_VALIDATE_THEN_WRITE = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from recipes.cli.validate import check_run_dir
    base, me, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    for i in range(rounds):
        (base / f"ready-{i}-{me}").touch()
        deadline = time.monotonic() + 30  # the other process died: stop instead of waiting forever
        while len(list(base.glob(f"ready-{i}-*"))) < 2:
            if time.monotonic() > deadline:
                sys.exit(3)
        run = base / "outputs" / f"day{i}" / f"time{i}"
        check_run_dir("hydra.run.dir", run)
        run.mkdir(parents=True, exist_ok=True)
        (run / f"rank-{me}.txt").write_text(me)
    print("ok")
    """
)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def test_two_processes_validating_one_fresh_run_dir_together_never_fail(tmp_path: Path) -> None:
    rounds = 150
    cmd = [sys.executable, "-c", _VALIDATE_THEN_WRITE, str(tmp_path)]
    with background("spin", 1):  # the loaded host the race showed up on
        procs = [
            subprocess.Popen(
                [*cmd, str(r), str(rounds)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1].decode()[-2000:] for o in outs]
    for i in range(rounds):
        run = tmp_path / "outputs" / f"day{i}" / f"time{i}"
        assert sorted(f.name for f in run.iterdir()) == ["rank-0.txt", "rank-1.txt"]


# 8 torchrun groups of 2 ranks, started two at a time: each pair's four ranks and two agents load the two
# cores for each other, as a spinning process did (which cost a core for the whole test and found nothing
# more). Each group is a fresh start (the race is in the first seconds); the default suite's 150-round test
# above drives the run-dir check itself far harder. (20 groups until 2026-12-04, 12 until 2026-12-07: CI
# time.)
@pytest.mark.slow
def test_eight_torchrun_groups_started_from_fresh_directories_on_a_loaded_cpu_all_succeed(
    tmp_path: Path,
) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "recipes.train", "+task=image_classification", "trainer=smoke", "trainer.max_steps=1"]
    cmd += ["trainer.parallel=ddp", "trainer.ckpt_every=0"]
    failed = []
    for pair in range(4):
        started = []
        for i in (2 * pair, 2 * pair + 1):
            cwd = tmp_path / f"fresh{i}"
            cwd.mkdir()
            env = _env(TORCHKILN_DIST_TIMEOUT="60")
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            started.append((i, cwd, proc))
        for i, cwd, proc in started:
            _, err = proc.communicate(timeout=300)
            runs = list((cwd / "outputs" / "image_classification").glob("*/model.safetensors"))
            if proc.returncode != 0 or len(runs) != 1:
                failed.append((i, proc.returncode, err.decode()[-1500:]))
    assert failed == []


@pytest.mark.slow  # three two-job sweeps started together into fresh sweep dirs: six jobs on two cores
def test_a_submitit_local_sweep_of_two_jobs_into_one_sweep_dir_never_races(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "recipes.train", "-m", "+task=image_classification", "trainer=smoke"]
    base += ["trainer.max_steps=1", "hydra/launcher=submitit_local", "optim.lr=1e-3,3e-3"]
    sweeps = [tmp_path / f"day{i}" / "sweep" for i in range(3)]  # neither folder exists: the jobs create them
    procs = [
        subprocess.Popen(
            [*base, f"hydra.sweep.dir={sweep}"],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for sweep in sweeps
    ]
    errs = [p.communicate(timeout=300)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for e in errs]
    for sweep in sweeps:
        results = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/result.json"))]
        assert [r["status"] for r in results] == ["ok", "ok"], results
