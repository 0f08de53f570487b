"""The embedded KJV benchmarks (`text.benchmarks`): the generated lm-eval task folder is deterministic and
loads offline through lm-eval's own TaskManager; its questions are about held-out verses only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from text.benchmarks import TASKS, baseline, task_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One generated folder for the module's read-only checks."""
    return task_folder(tmp_path_factory.mktemp("benchmarks"))


def rows(folder: Path, task: str) -> list[dict]:
    """The JSONL rows of `task` in `folder`."""
    return [json.loads(line) for line in (folder / f"{task}.jsonl").read_text().splitlines()]


def test_folder_holds_every_task(folder: Path) -> None:
    for task in TASKS:
        assert (folder / f"{task}.yaml").is_file()
        assert 100 <= len(rows(folder, task)) <= 400
    assert baseline("kjv_book_mc") == 0.25
