"""The `logger` config group: which metrics sinks a run writes besides `metrics.jsonl` (always written).

`logger=tensorboard` (the default), `logger=[tensorboard,csv]`, `logger=wandb`, `logger=mlflow`,
`logger=none`. Hydra merges each chosen option's file into the `logger` section, where it sets its own key
(conf/logger/csv.yaml holds `csv: {}`), so the section holds one entry per chosen logger and the schema
below checks each entry's keys and values like any other section's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from core.logging.sinks import CSVLogger, Logger, TensorBoardLogger
from core.logging.trackers import MLflowConfig, MLflowLogger, WandbConfig, WandbLogger


@dataclass
class TensorBoardConfig:
    """`logger=tensorboard`: event files in RUN_DIR/tb (scalars, and the hyperparameters as HParams)."""


@dataclass
class CSVConfig:
    """`logger=csv`: RUN_DIR/metrics.csv, a column per metric."""


@dataclass
class LoggerConfig:
    """The chosen loggers, each with its settings; an unchosen one is null."""

    #: TensorBoard event files in RUN_DIR/tb, with the hyperparameters (logger=tensorboard, the default)
    tensorboard: Optional[TensorBoardConfig] = None  # noqa: UP045  (OmegaConf reads typing.Optional)
    #: RUN_DIR/metrics.csv, a column per metric (logger=csv)
    csv: Optional[CSVConfig] = None  # noqa: UP045
    #: Weights & Biases, offline unless logger.wandb.mode=online (logger=wandb; the wandb extra)
    wandb: Optional[WandbConfig] = None  # noqa: UP045
    #: MLflow tracking into RUN_DIR/mlflow/mlflow.db or a given store (logger=mlflow; the mlflow extra)
    mlflow: Optional[MLflowConfig] = None  # noqa: UP045


def build_loggers(cfg: DictConfig) -> list[Logger]:
    """The loggers `cfg.logger` chooses; the trackers get the resolved config, and the task's name as their
    project (W&B) or experiment (MLflow) unless one is given."""
    chosen = cfg.logger
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    task = cfg.task.name
    out: list[Logger] = []
    if chosen.tensorboard is not None:
        out.append(TensorBoardLogger())
    if chosen.csv is not None:
        out.append(CSVLogger())
    if chosen.wandb is not None:
        w: WandbConfig = OmegaConf.to_object(chosen.wandb)  # type: ignore[assignment]
        w = dataclasses.replace(w, project=w.project or task)
        out.append(WandbLogger(w, config_yaml=config_yaml))
    if chosen.mlflow is not None:
        m: MLflowConfig = OmegaConf.to_object(chosen.mlflow)  # type: ignore[assignment]
        m = dataclasses.replace(m, experiment=m.experiment or task)
        out.append(MLflowLogger(m, config_yaml=config_yaml))
    return out


def unchosen_logger_key(conf_dir: str, overrides: list[str]) -> str | None:
    """Why `overrides` fail if they set a key of a logger they do not choose (`logger.wandb.mode=online`
    alone): Hydra cannot set a key inside a null section and fails with an assertion that names nothing.
    None if that is not the cause."""
    keys = [o.lstrip("+~").partition("=")[0] for o in overrides]
    touched = [k for k in keys if k.startswith("logger.") and k.count(".") >= 2]
    if not touched:
        return None
    rest = [o for o, k in zip(overrides, keys, strict=True) if not k.startswith("logger.")]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=conf_dir, version_base=None):
            section: Any = compose("train", overrides=rest).logger
    except Exception:  # noqa: BLE001  (the caller reports the composition error itself)
        return None
    finally:
        GlobalHydra.instance().clear()
    on = [k for k in section if section[k] is not None]
    for key in touched:
        name = key.split(".")[1]
        if name in section and section[name] is None:
            return (
                f"{key}: the {name} logger is not chosen (logger={','.join(on) or 'none'}); "
                f"choose it, e.g. logger=[{','.join([*on, name])}]"
            )
    return None
