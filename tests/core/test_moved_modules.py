"""The import paths the README's "Using core" names: the packages core is grouped in give them, and the
old flat paths (and vision's EMA alias) are gone, not kept as shims (CHANGELOG.md says where each moved)."""

from __future__ import annotations

import importlib

import pytest

OLD_PATHS = {
    "core.task": "core.loop.task",
    "core.trainer": "core.loop.trainer",
    "core.callbacks": "core.loop.callbacks",
    "core.metrics": "core.logging.sinks",
    "vision.ema": "core.loop.ema",
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_path_is_gone_and_its_new_one_imports(old: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    importlib.import_module(OLD_PATHS[old])


def test_the_names_the_readme_uses_import_from_their_packages() -> None:
    from core.logging.sinks import CSVLogger, Logger, TensorBoardLogger
    from core.loop.callbacks import Callback
    from core.loop.task import ShapeHints, Task
    from core.loop.trainer import Trainer, TrainerConfig

    names = (CSVLogger, Logger, TensorBoardLogger, Callback, ShapeHints, Task, Trainer, TrainerConfig)
    assert all(isinstance(c, type) for c in names)


def test_the_deprecated_sharded_checkpoint_shim_is_gone() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("core.distributed.checkpoint")
