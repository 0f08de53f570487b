"""Build the task a run config names: one place for the train, generate and transcribe entry points."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.registry import TASKS
from core.task import Task


def build_task(cfg: DictConfig | dict[str, Any]) -> Task:
    """The task of a composed or saved run config; the caller imports the domain that registers it."""
    c = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    task_cfg = dict(c["task"])
    name = task_cfg.pop("name")
    return TASKS.build(name, model=dict(c["model"]), data=dict(c["data"]), **task_cfg)
