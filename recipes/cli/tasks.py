"""Build the task a run config names: one place for the train, generate and transcribe entry points."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.errors import ConfigError
from core.loop.task import Task
from core.registry import TASKS


def load_run_config(path: Path) -> dict[str, Any]:
    """A saved run's config (`RUN/.hydra/config.yaml`) as plain values, resolving nothing: an interpolation
    such as `${oc.env:...}` in a file someone else wrote would read this machine's environment or run a
    resolver, so a file that holds one is refused in one line."""
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    found = _first_interpolation(cfg)
    if found is not None:
        key, value = found
        raise ConfigError(
            f"{path}: {key} holds the interpolation {value!r}; a saved run config must hold plain values "
            "(replace it with its value)"
        )
    return cfg


def _first_interpolation(node: Any, key: str = "") -> tuple[str, str] | None:
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = ((str(i), v) for i, v in enumerate(node))
    else:
        return (key, node) if isinstance(node, str) and "${" in node else None
    for k, v in items:
        hit = _first_interpolation(v, f"{key}.{k}" if key else str(k))
        if hit is not None:
            return hit
    return None


def build_task(cfg: DictConfig | dict[str, Any]) -> Task:
    """The task of a composed or saved run config; the caller imports the domain that registers it."""
    c = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    task_cfg = dict(c["task"])
    name = task_cfg.pop("name")
    TASKS.get(name).check_parts(name, c["model"], c["data"])
    return TASKS.build(name, model=dict(c["model"]), data=dict(c["data"]), **task_cfg)
