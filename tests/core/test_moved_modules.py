"""The import paths the README's "Using core" names from before core was grouped into packages: each still
imports, with a DeprecationWarning, and gives the new module's own objects (so isinstance checks agree)."""

from __future__ import annotations

import importlib
import sys

import pytest

OLD_PATHS = {
    "core.task": "core.loop.task",
    "core.trainer": "core.loop.trainer",
    "core.callbacks": "core.loop.callbacks",
    "core.metrics": "core.logging.sinks",
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_path_imports_the_new_module_with_a_deprecation_warning(
    old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = importlib.import_module(OLD_PATHS[old])
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning) as caught:
        module = importlib.import_module(old)
    assert module is new
    assert any(OLD_PATHS[old] in str(w.message) for w in caught)


def test_the_names_the_readme_uses_resolve_through_the_old_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    for old in OLD_PATHS:
        monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning):
        from core.callbacks import Callback
        from core.metrics import CSVLogger, Logger, TensorBoardLogger
        from core.task import ShapeHints, Task
        from core.trainer import Trainer, TrainerConfig
    from core.logging import sinks
    from core.loop import callbacks, task, trainer

    assert (Trainer, TrainerConfig, Task, ShapeHints) == (
        trainer.Trainer,
        trainer.TrainerConfig,
        task.Task,
        task.ShapeHints,
    )
    assert Callback is callbacks.Callback
    assert (Logger, CSVLogger, TensorBoardLogger) == (sinks.Logger, sinks.CSVLogger, sinks.TensorBoardLogger)


def test_the_deprecated_sharded_checkpoint_shim_is_gone() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("core.distributed.checkpoint")
