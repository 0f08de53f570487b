"""Embedded benchmarks: lm-eval tasks over KJV verses no training set here sees, scored with no download.

`task_folder()` is the folder to hand lm-eval as its include path (group `kjv`: kjv_next_words, kjv_book_mc,
kjv_book_gen, kjv_cloze); `baseline(task)` is what guessing scores on it, for centred accuracy
((acc - baseline) / (1 - baseline), as nanochat reports). docs/evaluation.md describes each task.
"""

from __future__ import annotations

from core.errors import unknown_choice
from text.benchmarks.folder import task_folder
from text.benchmarks.kjv_docs import CHOICES, TASKS, majority_share, task_docs

__all__ = ["TASKS", "baseline", "task_folder"]


def baseline(task: str) -> float:
    """The score of guessing on `task`: 1/4 on the four-way choices; on kjv_book_gen, the share of its
    questions that naming the commonest book answers."""
    if task not in TASKS:
        raise unknown_choice("task", task, TASKS)
    if task == "kjv_book_gen":
        return majority_share(task_docs()[task], "book")
    return 1 / CHOICES
