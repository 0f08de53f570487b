"""core.logging.sinks.CSVLogger and core.logging.trackers (W&B offline, MLflow on a local SQLite store): what
each writes,
read back with the tracker's own client where it has one, and how a resumed run continues."""

from __future__ import annotations

import csv
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from core.errors import ConfigError
from core.logging.sinks import CSVLogger
from core.logging.trackers import MLflowConfig, MLflowLogger, WandbConfig, WandbLogger
from tests.helpers import fault, fit_toy, offline_wandb_env, read_metrics, read_wandb_run


def csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_csv_header_grows_as_keys_appear_and_each_row_keeps_its_values(tmp_path: Path) -> None:
    log = CSVLogger()
    log.open(tmp_path, resume_step=None)
    log.log(1, {"train/loss": 0.5}, epoch=0)
    log.log(2, {"train/loss": 0.25}, epoch=0)
    log.log(2, {"val/loss": 0.75, "val/accuracy": 0.125}, epoch=0)  # new keys: the file is rewritten
    log.log(3, {"train/loss": 1 / 3}, epoch=1)
    log.close()
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[0] == "step,epoch,train/loss,val/loss,val/accuracy"
    # floats as repr writes them: the same digits as metrics.jsonl, read back exactly
    assert lines[1:] == ["1,0,0.5,,", "2,0,0.25,,", "2,0,,0.75,0.125", f"3,1,{1 / 3!r},,"]


def test_csv_of_a_resumed_run_drops_rows_after_its_step_and_a_torn_last_row(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("step,epoch,train/loss\n1,0,0.5\n2,0,0.4\n3,0,0.3\n4,0,0.2\n5,0,0.")  # killed mid-row
    log = CSVLogger()
    log.open(tmp_path, resume_step=3)
    log.log(4, {"train/loss": 0.125}, epoch=0)
    log.close()
    assert path.read_text() == "step,epoch,train/loss\n1,0,0.5\n2,0,0.4\n3,0,0.3\n4,0,0.125\n"


def test_csv_of_a_run_resumed_mid_epoch_matches_metrics_jsonl_with_no_step_twice(tmp_path: Path) -> None:
    fit_toy(tmp_path / "a", callbacks=[CSVLogger()])
    # the run was stopped after step 8: its checkpoint survived, and rows up to step 10 were logged
    b = tmp_path / "b"
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_00000008", b / "checkpoints" / "step_00000008")
    kept = [r for r in csv_rows(tmp_path / "a" / "metrics.csv") if int(r["step"]) <= 10]
    with (b / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, list(kept[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(kept)
    fit_toy(b, resume="auto", callbacks=[CSVLogger()])
    rows = csv_rows(b / "metrics.csv")
    jsonl = read_metrics(b)
    train = [int(r["step"]) for r in rows if r["train/loss"]]
    assert train == list(range(1, 16))  # 5 steps per epoch, 3 epochs, each once
    losses = {int(r["step"]): r["train/loss"] for r in rows if r["train/loss"]}
    straight = csv_rows(tmp_path / "a" / "metrics.csv")
    assert losses == {int(r["step"]): r["train/loss"] for r in straight if r["train/loss"]}  # bit-exact
    resumed = [r for r in rows if int(r["step"]) > 8]
    assert [int(r["step"]) for r in resumed] == [j["step"] for j in jsonl]  # this run's rows, one each
    for r, j in zip(resumed, jsonl, strict=True):
        assert {k: float(v) for k, v in r.items() if v} == {k: v for k, v in j.items() if k != "time"}


def test_a_missing_tracker_package_is_one_line_naming_the_install(tmp_path: Path, monkeypatch) -> None:
    for module, logger in (("wandb", WandbLogger(WandbConfig())), ("mlflow", MLflowLogger(MLflowConfig()))):
        monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
        with pytest.raises(ConfigError) as e:
            logger.open(tmp_path, resume_step=None)
        assert fault(e.value) == ("logger", module, (f"torchkiln[{module}] installed",))
        logger.close()


# ---- W&B ---------------------------------------------------------------------------------------------------


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """wandb, with no WANDB_MODE or key from the environment (the config alone must keep it offline)."""
    wandb = pytest.importorskip("wandb")
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED"):
        monkeypatch.delenv(key, raising=False)
    for key, value in offline_wandb_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    return wandb


def test_wandb_offline_run_holds_config_rows_and_the_resolved_config(tmp_path: Path, offline_wandb) -> None:
    log = WandbLogger(WandbConfig(project="toy", tags=["a"]), config_yaml="task:\n  name: toy\n")
    log.open(tmp_path, resume_step=None)
    log.log_hparams({"trainer.batch_size": 8, "model.name": "mlp", "compile.cache_dir": None})
    log.log(1, {"train/loss": 0.5}, epoch=0)
    log.log(2, {"train/loss": 0.25}, epoch=0)
    log.log(2, {"val/accuracy": 0.75}, epoch=0)  # the same step: one history row
    log.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    got = read_wandb_run(next(run.glob("run-*.wandb")))
    assert got["id"] == (tmp_path / "wandb" / "run_id").read_text().strip() and got["project"] == "toy"
    assert got["config"] == {"trainer.batch_size": 8, "model.name": "mlp", "compile.cache_dir": None}
    assert got["history"] == {1: {"train/loss": 0.5}, 2: {"train/loss": 0.25, "val/accuracy": 0.75}}
    assert "run_config.yaml" in got["files"]
    assert (run / "files" / "run_config.yaml").read_text() == "task:\n  name: toy\n"


def test_a_resumed_wandb_run_continues_the_same_run(tmp_path: Path, offline_wandb) -> None:
    for resume_step, steps in ((None, (1, 2, 3)), (3, (4, 5))):
        log = WandbLogger(WandbConfig())
        log.open(tmp_path, resume_step=resume_step)
        for s in steps:
            log.log(s, {"train/loss": 1 / s})
        log.close()
    runs = [read_wandb_run(p) for p in sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))]
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"]  # `wandb sync` uploads both into one run
    assert [list(r["history"]) for r in runs] == [[1, 2, 3], [4, 5]]


# ---- MLflow ------------------------------------------------------------------------------------------------


def test_mlflow_run_in_the_run_dir_holds_params_metrics_config_and_continues_when_resumed(
    tmp_path: Path,
) -> None:
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    long = "x" * 7000  # over MLflow's limit for a param value
    first = MLflowLogger(MLflowConfig(experiment="toy"), config_yaml="task:\n  name: toy\n")
    first.open(tmp_path, resume_step=None)
    first.log_hparams({"trainer.batch_size": 8, "resume": None, "data.classes": long})
    first.log(1, {"train/loss": 0.5})
    first.log(2, {"train/loss": 0.25, "val/accuracy": 0.75})
    first.close()
    again = MLflowLogger(MLflowConfig(experiment="toy"))
    again.open(tmp_path, resume_step=2)
    again.log_hparams({"trainer.batch_size": 8, "resume": "auto", "seed": 1})  # `resume` changed: kept
    again.log(3, {"train/loss": 0.125})
    again.close()
    assert again.run_id == first.run_id == (tmp_path / "mlflow" / "run_id").read_text().strip()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and client.get_experiment(run.info.experiment_id).name == "toy"
    params = run.data.params
    assert params["trainer.batch_size"] == "8" and params["resume"] == "None" and params["seed"] == "1"
    assert 0 < len(params["data.classes"]) < len(long)
    history = [(m.step, m.value) for m in client.get_metric_history(first.run_id, "train/loss")]
    assert history == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert client.download_artifacts(first.run_id, "config.yaml", str(tmp_path / "dl"))
    assert (tmp_path / "dl" / "config.yaml").read_text() == "task:\n  name: toy\n"
