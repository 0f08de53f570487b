"""Experiment trackers as `Logger`s: Weights & Biases and MLflow, each writing inside the run directory by
default, with no server and nothing sent over the network.

Both packages are optional extras (`pip install 'torchkiln[wandb]'`, `'torchkiln[mlflow]'`), imported when
the run opens the logger; a missing one is a ConfigError naming the pip command. Each keeps its run's id in
RUN_DIR, so a resumed run continues the same tracker run; rows a killed run logged after its last
checkpoint stay there (neither lets a client rewrite history), while a preempted run stops at its checkpoint
and has none.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import secrets
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Optional

from core.bounds import Bounds
from core.errors import ConfigError, Preempted
from core.files import write_text_atomic
from core.logging.sinks import Logger, writing

WANDB_MODES = ("offline", "online")


def _need(module: str, extra: str) -> ModuleType:
    """Import an optional tracker package, or say in one line how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        why = f"logger={extra} needs the {extra} package: pip install 'torchkiln[{extra}]'"
        raise ConfigError(why, key="logger", value=extra, valid=(f"torchkiln[{extra}] installed",)) from None


def _run_id(path: Path, new: str) -> str:
    """The tracker run id kept in `path`, or `new`, written there first (atomically)."""
    if path.is_file():
        kept = path.read_text(encoding="utf-8").strip()
        if kept:
            return kept
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, new + "\n")
    return new


def _ending_error() -> BaseException | None:
    """The error that ends the run, if any (loggers close in the trainer's `finally`, where it is set)."""
    return sys.exc_info()[1]


@dataclass
class WandbConfig:
    """`logger=wandb`: Weights & Biases. Offline by default: the run is written to RUN_DIR/wandb and
    `wandb sync RUN_DIR/wandb/offline-run-*` uploads it later."""

    #: offline: nothing leaves this machine; online: stream to the W&B server (after `wandb login`)
    mode: Annotated[str, Bounds(choices=WANDB_MODES)] = "offline"
    #: the W&B project; null: the task's name
    project: Optional[str] = None  # noqa: UP045  (OmegaConf reads typing.Optional)
    #: the W&B entity (user or team); null: the account's default
    entity: Optional[str] = None  # noqa: UP045
    #: the run's display name; null: the run directory's name
    name: Optional[str] = None  # noqa: UP045
    #: labels for the run in the W&B interface
    tags: list[str] = field(default_factory=list)


class WandbLogger(Logger):
    """Rows to a W&B run (`wandb.log(metrics, step=step)`), the hyperparameters to its config and the
    resolved run config as the file `run_config.yaml`."""

    def __init__(self, cfg: WandbConfig, *, config_yaml: str = "") -> None:
        """`config_yaml`: the run's resolved config, saved with the run once it starts."""
        self.cfg, self.config_yaml = cfg, config_yaml
        self._run: Any = None

    def open(self, run_dir: Path, resume_step: int | None) -> None:
        """Start (or, with the id kept in RUN_DIR/wandb/run_id, continue) the W&B run under RUN_DIR."""
        wandb = _need("wandb", "wandb")
        run_id = _run_id(run_dir / "wandb" / "run_id", secrets.token_hex(8))
        try:
            self._run = wandb.init(
                mode=self.cfg.mode,
                dir=str(run_dir),
                id=run_id,
                resume="allow",
                project=self.cfg.project,
                entity=self.cfg.entity,
                name=self.cfg.name or run_dir.name,
                tags=list(self.cfg.tags) or None,
                # the terminal and train.log already hold the output: W&B does not wrap stdout/stderr
                settings=wandb.Settings(console="off"),
            )
        except wandb.Error as e:  # e.g. online without `wandb login`
            raise ConfigError(f"logger=wandb could not start a run: {_first_line(e)}") from None

    def log_hparams(self, params: dict[str, Any]) -> None:
        """The hyperparameters as the run's config; the resolved config as a file of the run."""
        if self._run is None:
            return
        self._run.config.update(params, allow_val_change=True)  # a resumed run may change e.g. `resume`
        if self.config_yaml:
            path = Path(self._run.dir) / "run_config.yaml"
            with writing(path):
                path.write_text(self.config_yaml, encoding="utf-8")
            self._run.save(str(path), base_path=self._run.dir, policy="now")

    def log(self, step: int, metrics: dict[str, float], **extra: Any) -> None:
        """One W&B history row at `step` (a training window and an evaluation at one step merge)."""
        if self._run is not None:
            self._run.log(metrics, step=step)

    def close(self) -> None:
        """Finish the run, failed if an error ends the training, and wait until it is on disk."""
        if self._run is not None:
            run, self._run = self._run, None
            err = _ending_error()
            run.finish(exit_code=0 if err is None else int(getattr(err, "exit_code", 1)))
            import wandb

            # finish() returns before W&B's service process has written the run out; teardown waits for it
            # (its atexit hook would too, but a torchrun rank ends with os._exit), unless another run of
            # this process still uses the service
            if wandb.run is None:
                wandb.teardown()


@dataclass
class MLflowConfig:
    """`logger=mlflow`: MLflow tracking, by default into an SQLite database in the run directory
    (`mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow/mlflow.db` shows it)."""

    #: where runs are recorded (e.g. http://host:5000); null: sqlite:///RUN_DIR/mlflow/mlflow.db
    tracking_uri: Optional[str] = None  # noqa: UP045  (OmegaConf reads typing.Optional)
    #: the experiment; null: the task's name
    experiment: Optional[str] = None  # noqa: UP045
    #: the run's name; null: the run directory's name
    run_name: Optional[str] = None  # noqa: UP045


class MLflowLogger(Logger):
    """Rows to an MLflow run's metrics (with their step), the hyperparameters to its params and the resolved
    run config to the artifact `config.yaml`."""

    #: MLflow sends at most this many params in one request (its MAX_PARAMS_TAGS_PER_BATCH)
    PARAMS_PER_BATCH = 100

    def __init__(self, cfg: MLflowConfig, *, config_yaml: str = "") -> None:
        """`config_yaml`: the run's resolved config, stored as an artifact once the run starts."""
        self.cfg, self.config_yaml = cfg, config_yaml
        self._client: Any = None
        self.run_id = ""

    def open(self, run_dir: Path, resume_step: int | None) -> None:
        """Connect to the tracking store and start (or, with the id kept in RUN_DIR/mlflow/run_id, continue)
        the run.

        The default store is SQLite, not MLflow's `./mlruns` files: MLflow 3 keeps the file store in
        maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE=true, while SQLite is its own default
        and needs no server (sqlalchemy and alembic, in the `mlflow` extra)."""
        _need("mlflow", "mlflow")
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        folder = run_dir / "mlflow"
        with writing(folder):
            folder.mkdir(parents=True, exist_ok=True)
        uri = self.cfg.tracking_uri or f"sqlite:///{(folder / 'mlflow.db').absolute()}"
        try:
            with _quiet_store_setup():
                self._client = MlflowClient(tracking_uri=uri)
                kept = folder / "run_id"
                run_id = kept.read_text(encoding="utf-8").strip() if kept.is_file() else ""
                if run_id and self._has_run(run_id):
                    self._client.update_run(run_id, status="RUNNING")
                else:
                    run_id = self._create_run(folder, run_dir.name)
                    with writing(kept):
                        write_text_atomic(kept, run_id + "\n")
        except MlflowException as e:
            raise ConfigError(f"logger=mlflow: {uri}: {_first_line(e)}") from None
        self.run_id = run_id

    def _has_run(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self._client.get_run(run_id)
        except MlflowException:
            return False  # e.g. another tracking_uri than the first run's
        return True

    def _create_run(self, folder: Path, default_name: str) -> str:
        """A new run in the configured experiment (created if missing; with the default store its artifacts
        go to RUN_DIR/mlflow/artifacts)."""
        name = self.cfg.experiment or "torchkiln"
        exp = self._client.get_experiment_by_name(name)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            where = None if self.cfg.tracking_uri else (folder / "artifacts").absolute().as_uri()
            exp_id = self._client.create_experiment(name, artifact_location=where)
        return self._client.create_run(exp_id, run_name=self.cfg.run_name or default_name).info.run_id

    def log_hparams(self, params: dict[str, Any]) -> None:
        """The hyperparameters as params (values cut to MLflow's length limit); a resumed run adds only the
        keys it lacks, since MLflow refuses to change a param. The resolved config as `config.yaml`."""
        if self._client is None:
            return
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        known = self._client.get_run(self.run_id).data.params
        new = [Param(k, str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in params.items() if k not in known]
        for i in range(0, len(new), self.PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=new[i : i + self.PARAMS_PER_BATCH])
        if self.config_yaml:
            self._client.log_text(self.run_id, self.config_yaml, "config.yaml")

    def log(self, step: int, metrics: dict[str, float], **extra: Any) -> None:
        """Each metric at `step`, in one request."""
        if self._client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()]
        )

    def close(self) -> None:
        """End the run: FINISHED, KILLED when preempted or interrupted, FAILED on any other error."""
        if self._client is not None:
            client, self._client = self._client, None
            err = _ending_error()
            stopped = isinstance(err, (Preempted, KeyboardInterrupt))
            client.set_terminated(
                self.run_id, status="FINISHED" if err is None else "KILLED" if stopped else "FAILED"
            )


@contextlib.contextmanager
def _quiet_store_setup() -> Any:
    """Creating the SQLite store runs MLflow's schema migrations, which log a line each through alembic (into
    the run's console and train.log) and trip a SQLAlchemy 2.1 deprecation warning in MLflow's own mappers:
    neither is the user's business."""
    alembic = logging.getLogger("alembic")
    level = alembic.level
    alembic.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*``noload`` loader strategy")
            yield
    finally:
        alembic.setLevel(level)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
