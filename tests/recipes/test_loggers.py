"""`logger=...` through the CLI in a real process: what each chosen logger writes matches `metrics.jsonl`,
the hyperparameters are recorded once, a resumed run logs no step twice, and bad choices fail up front."""

from __future__ import annotations

import csv
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from recipes.train import main
from tests.helpers import cli_env, offline_wandb_env, read_metrics, read_wandb_run

TINY = ["+task=image_classification", "trainer.progress=false", "model.width=16"]
SHORT = [*TINY, "trainer.max_steps=4", "trainer.log_every=1"]


def csv_rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_csv_and_tensorboard_hold_the_rows_of_metrics_jsonl_and_the_hparams(tmp_path: Path, cli_here) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    run = tmp_path / "run"
    r = cli_here(*SHORT, "logger=[csv,tensorboard]", f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    rows, table = read_metrics(run), csv_rows(run)
    assert len(rows) == 5  # 4 training rows and the evaluation at step 4
    keys = list(dict.fromkeys(k for row in rows for k in row if k != "time"))
    assert list(table[0]) == keys  # step, epoch, then each metric in order of first appearance
    for row, line in zip(rows, table, strict=True):  # the same numbers, digit for digit
        assert {k: float(v) for k, v in line.items() if v} == {k: v for k, v in row.items() if k != "time"}

    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    for key in ("train/loss", "val/accuracy"):
        logged = [(row["step"], row[key]) for row in rows if key in row]
        # TensorBoard stores a scalar as float32
        assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars(key)] == logged
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["trainer.batch_size"].number_value == 64 and hparams["trainer.max_steps"].number_value == 4
    assert hparams["model.name"].string_value == "small_cnn"


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_logger_none_writes_only_metrics_jsonl(tmp_path: Path, cli) -> None:
    run = tmp_path / "run"
    r = cli(*SHORT, "logger=none", f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(read_metrics(run)) == 5
    assert not (run / "tb").exists() and not (run / "metrics.csv").exists()


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_wandb_is_offline_by_config_and_holds_config_and_rows(
    tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED"):  # the config alone keeps it offline
        monkeypatch.delenv(key, raising=False)
    run = tmp_path / "run"
    r = cli(*SHORT, "logger=wandb", f"hydra.run.dir={run}", env=offline_wandb_env(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    (offline,) = (run / "wandb").glob("offline-run-*")
    got = read_wandb_run(next(offline.glob("run-*.wandb")))
    assert got["project"] == "image_classification"
    assert got["config"]["trainer.batch_size"] == 64 and got["config"]["logger.wandb.mode"] == "offline"
    expected: dict[int, dict[str, float]] = {}
    for row in read_metrics(run):  # W&B merges the rows of one step
        expected.setdefault(row["step"], {}).update({k: v for k, v in row.items() if "/" in k})
    assert got["history"] == expected
    resolved = OmegaConf.load(offline / "files" / "run_config.yaml")
    assert resolved == OmegaConf.load(run / ".hydra" / "config.yaml")  # no interpolation to resolve here


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_mlflow_run_holds_params_metric_history_and_config(tmp_path: Path, cli) -> None:
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    run = tmp_path / "run"
    r = cli(*SHORT, "trainer.eval_every=2", "logger=mlflow", f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow' / 'mlflow.db'}")
    run_id = (run / "mlflow" / "run_id").read_text().strip()
    found = client.get_run(run_id)
    assert found.info.status == "FINISHED" and found.info.run_name == "run"
    assert client.get_experiment(found.info.experiment_id).name == "image_classification"
    assert found.data.params["trainer.batch_size"] == "64" and found.data.params["model.name"] == "small_cnn"
    for key in ("val/accuracy", "train/loss"):
        logged = [(row["step"], row[key]) for row in read_metrics(run) if key in row]
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, key)] == logged
    config = client.download_artifacts(run_id, "config.yaml", str(tmp_path / "artifacts"))
    assert OmegaConf.load(config) == OmegaConf.load(run / ".hydra" / "config.yaml")


@pytest.mark.slow  # three CLI runs (#38 point 5); tests/recipes/test_train.py's SIGTERM resume stays default
def test_a_run_stopped_by_sigterm_and_resumed_logs_no_step_twice(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "recipes.train", *TINY, "trainer.max_steps=12", "trainer.log_every=1"]
    cmd += ["trainer.eval_every=4", "logger=[csv,tensorboard]", f"hydra.run.dir={run}"]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for line in proc.stdout:  # the loop is stepping: stop it as a scheduler would
        if line.startswith("[step 5/"):
            proc.send_signal(signal.SIGTERM)
            break
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-2000:]
    stopped = int(err.strip().splitlines()[-1].split("after step ")[1].split(":")[0])
    assert stopped < 12 and [int(r["step"]) for r in csv_rows(run)][-1] == stopped
    r = subprocess.run(cmd + ["resume=auto"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    table = csv_rows(run)
    train = [int(row["step"]) for row in table if row["train/loss"]]
    evals = [int(row["step"]) for row in table if row["val/loss"]]
    assert train == list(range(1, 13)) and evals == [4, 8, 12]
    rows = [row for row in read_metrics(run) if "train/loss" in row]
    assert [row["step"] for row in rows] == train  # metrics.jsonl, cut back the same way
    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == train


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["logger=bogus"], "unknown logger 'bogus'; available: csv, mlflow, none, tensorboard, wandb"),
        (["logger=[csv,bogus]"], "unknown logger 'bogus'; available: csv, mlflow, none, tensorboard, wandb"),
        (["logger=wandb", "logger.wandb.mode=sideways"], "logger.wandb.mode=sideways is unknown"),
        (["logger.wandb.mode=sideways"], "logger.wandb.mode: the wandb logger is not chosen"),
        (["logger=mlflow", "logger.mlflow.nope=1"], "unknown config key 'logger.mlflow.nope'"),
    ],
)
def test_a_bad_logger_choice_is_one_line_naming_it_exit_2(capsys, args: list[str], expected: str) -> None:
    assert main([*TINY, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {expected}") and len(err.strip().splitlines()) == 1, err
