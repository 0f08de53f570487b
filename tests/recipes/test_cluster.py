"""recipes.cli.cluster and the cluster launchers: submitit tasks as ranks, the slurm config, a local sweep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from core.distributed import dist_env
from core.errors import ConfigError
from recipes.cli.cluster import TORCHRUN_VARS, export_task_ranks
from recipes.cli.config import register_configs
from tests.helpers import cli_env, compose_train, fault

register_configs()
TINY = ["+task=image_classification", "trainer.progress=false", "model.width=16"]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launch variables from the host: the test sets the job's."""
    names = [k for k in os.environ if k.startswith(("SLURM_", "SUBMITIT_"))]
    for k in (*TORCHRUN_VARS, "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES", *names):
        monkeypatch.setenv(k, "")  # recorded, so what submitit's export sets is undone after the test
        monkeypatch.delenv(k)
    return monkeypatch


def slurm_task(mp: pytest.MonkeyPatch, procid: int, localid: int, nodeid: int, ntasks: int = 8) -> None:
    """The variables srun gives task `procid` of a 2-node job (4 tasks per node) in submitit's sbatch."""
    mp.setenv("SUBMITIT_EXECUTOR", "slurm")
    env = {"JOB_ID": "4242", "NTASKS": ntasks, "JOB_NUM_NODES": 2, "JOB_NODELIST": "gpu[017-018]"}
    env |= {"PROCID": procid, "LOCALID": localid, "NODEID": nodeid}
    for k, v in env.items():
        mp.setenv(f"SLURM_{k}", str(v))


def test_each_task_of_a_slurm_job_becomes_a_rank(clean_env: pytest.MonkeyPatch) -> None:
    ports = set()
    for procid in (0, 5):
        for k in TORCHRUN_VARS:
            clean_env.delenv(k, raising=False)
        slurm_task(clean_env, procid=procid, localid=procid % 4, nodeid=procid // 4)
        assert export_task_ranks() is True
        env = dist_env()
        assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (procid, 8, procid % 4, 4)
        assert os.environ["MASTER_ADDR"] == "gpu017"  # the first node of the job
        assert "CUDA_VISIBLE_DEVICES" not in os.environ  # the process group pins cuda:LOCAL_RANK
        ports.add(os.environ["MASTER_PORT"])
    assert len(ports) == 1  # every task derives the same port from the job id


def test_a_local_submitit_job_of_two_tasks_is_two_ranks(clean_env: pytest.MonkeyPatch) -> None:
    env = {"EXECUTOR": "local", "LOCAL_JOB_ID": "777", "LOCAL_NTASKS": "2", "LOCAL_JOB_NUM_NODES": "1"}
    env |= {"LOCAL_NODEID": "0", "LOCAL_GLOBALID": "1", "LOCAL_LOCALID": "1"}
    for k, v in env.items():
        clean_env.setenv(f"SUBMITIT_{k}", v)
    assert export_task_ranks() is True
    assert dist_env() == type(dist_env())(rank=1, world_size=2, local_rank=1, local_world_size=2)


def test_one_task_a_torchrun_launch_or_no_job_stay_as_they_are(clean_env: pytest.MonkeyPatch) -> None:
    assert export_task_ranks() is False  # a plain process
    slurm_task(clean_env, procid=0, localid=0, nodeid=0, ntasks=1)
    assert export_task_ranks() is False and "RANK" not in os.environ  # one task: one process
    slurm_task(clean_env, procid=0, localid=0, nodeid=0)
    clean_env.setenv("TORCHELASTIC_RUN_ID", "x")
    assert export_task_ranks() is False and "RANK" not in os.environ  # torchrun already set them


def test_tasks_as_ranks_and_torchrun_workers_per_task_are_refused_together(
    clean_env: pytest.MonkeyPatch,
) -> None:
    slurm_task(clean_env, procid=0, localid=0, nodeid=0)
    with pytest.raises(ConfigError) as e:
        export_task_ranks(nproc_per_node=4)
    assert fault(e.value) == ("dist.nproc_per_node", "4", ("1",))


class _Submitted(Exception):
    """Raised instead of calling sbatch: carries the script submitit wrote."""


def test_the_slurm_launcher_config_maps_to_the_sbatch_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # no cluster here: run the plugin's own launch() up to the sbatch call and read the script it made
    from submitit.slurm.slurm import SlurmExecutor

    def capture(self: SlurmExecutor, submissions: list) -> None:
        raise _Submitted(self._make_submission_file_text("python -u -m submitit.core._submit DIR", "0"))

    monkeypatch.setattr(SlurmExecutor, "_internal_process_submissions", capture)
    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # as if srun were here
    launch = [
        "hydra/launcher=slurm",
        "hydra.launcher.nodes=2",
        "hydra.launcher.gpus_per_node=8",
        "hydra.launcher.cpus_per_task=12",
        "hydra.launcher.mem_gb=480",
        "hydra.launcher.timeout_min=1440",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.account=proj",
        "hydra.launcher.qos=high",
        "hydra.launcher.signal_delay_s=300",
        "+hydra.launcher.additional_parameters.mail-type=END",
        f"hydra.sweep.dir={tmp_path}",
    ]
    cfg = compose_train([*TINY, *launch], hydra=True)
    launcher = cfg.hydra.launcher
    assert launcher.tasks_per_node == 8 and launcher.max_num_timeout == 3  # one task (rank) per GPU
    OmegaConf.set_readonly(cfg.hydra, False)
    cfg.hydra.job.name = "train"
    plugin = instantiate(launcher)
    plugin.config = cfg
    with pytest.raises(_Submitted) as sub:
        plugin.launch([["optim.lr=1e-3"]], initial_job_idx=0)
    sbatch = str(sub.value)
    for flag in (
        "--nodes=2",
        "--gpus-per-node=8",
        "--ntasks-per-node=8",
        "--cpus-per-task=12",
        "--mem=480GB",
        "--time=1440",
        "--partition=gpu",
        "--account=proj",
        "--qos=high",
        "--signal=USR2@300",  # the trainer's stop signal: it checkpoints, then submitit requeues
        "--mail-type=END",
    ):
        assert f"#SBATCH {flag}\n" in sbatch, (flag, sbatch)
    assert "\nsrun " in sbatch


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_a_submitit_local_sweep_runs_both_jobs_and_summarises_them(tmp_path: Path) -> None:
    # the cluster path without a cluster: each job a submitit-managed process, results through its pickles
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "recipes.train", "-m", "+task=image_classification", "trainer=smoke"]
    cmd += ["hydra/launcher=submitit_local", "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"]
    r = subprocess.run(cmd, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for job, lr in (("0", "optim.lr=0.001"), ("1", "optim.lr=0.003")):
        result = json.loads((sweep / job / "result.json").read_text())
        assert result["overrides"][-1] == lr and "val/accuracy" in result["metrics"]
    rows = (sweep / "sweep_summary.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("job,status,optim.lr,wall_s")
    assert list((sweep / ".submitit").glob("*/*_result.pkl"))  # submitit ran them, not the basic launcher
