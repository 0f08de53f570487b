"""`python -m recipes.predict ckpt=RUN_DIR|CKPT input=FILE|DIR|LIST [out=FILE] [batch_size=N]`: a trained
model's predictions for new inputs, for every task.

The task reads the input and says what a prediction is (`Task.prediction_inputs`, `Task.predict`):
image_classification: an image or a folder of them -> CSV (path, class, prob, class_2, prob_2, ...: the
`top_k` likeliest classes, named as in training). asr: an audio file, a folder of them or a JSONL manifest
(`audio_filepath`[, `text`]) -> JSONL (path, text[, reference]), and WER/CER where the manifest gives
references. text_classification: a .csv/.jsonl file with a `text` field, or .txt files -> CSV (id, class,
prob, ...). lm: a text file, one prompt per line -> JSONL (prompt, text). The model is built once and runs
`batch_size` items at a time under the run's device plan; the predictions go to `out` (default:
RUN_DIR/predictions.csv or .jsonl) and one JSON line on stdout says where, how many, and any scores.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch

from core.bounds import Bounds
from core.errors import ConfigError, DataError
from core.files import write_text_atomic
from core.loop.task import Task
from core.registry import TASKS
from recipes.cli.catalog import task_names
from recipes.cli.command import command
from recipes.cli.options import ArgumentError, check, fields_of, help_text, parse_args, require
from recipes.cli.runs import Run, load_run, run_config

USAGE = "usage: python -m recipes.predict ckpt=RUN_DIR|CKPT input=FILE|DIR|LIST [out=FILE] [key=value ...]"
#: the formats `out=` may name, by suffix
FORMATS = {".csv": "csv", ".jsonl": "jsonl"}


@dataclass
class PredictOptions:
    """The command's own keys."""

    #: the training run directory (its model.safetensors), or one of its checkpoints/step_* folders
    ckpt: str = ""
    #: what to predict on: a file, a folder, or a list (a manifest, a table); the task says which
    input: str = ""
    #: the predictions file, .csv or .jsonl; empty: RUN_DIR/predictions.csv|jsonl (the task's format)
    out: str = ""
    #: items per forward pass
    batch_size: Annotated[int, Bounds(ge=1)] = 32
    #: cpu, cuda, cuda:N, mps or auto; empty: the run's own device setting
    device: str = ""


def predict_items(
    run: Run, items: Sequence[Any], *, batch_size: int, options: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The task's prediction rows for `items`, `batch_size` at a time, without gradients and under the run's
    autocast; a progress bar on stderr when it is a terminal."""
    bar = None
    if sys.stderr.isatty() and len(items) > batch_size:
        from tqdm import tqdm

        bar = tqdm(total=len(items), unit="item", dynamic_ncols=True, leave=False)
    rows: list[dict[str, Any]] = []
    try:
        with torch.no_grad(), run.plan.autocast():
            for i in range(0, len(items), batch_size):
                chunk = items[i : i + batch_size]
                rows += run.task.predict(run.model, chunk, **(options or {}))
                if bar is not None:
                    bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return rows


def write_rows(path: Path, rows: Sequence[dict[str, Any]], fmt: str) -> None:
    """`rows` as CSV (a header of every key, in first-seen order) or JSONL, written atomically."""
    buf = io.StringIO()
    if fmt == "csv":
        keys = list(dict.fromkeys(k for r in rows for k in r))
        writer = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    else:
        buf.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, buf.getvalue())
    except OSError as e:
        raise DataError(f"cannot write {path} ({e.strerror or e}); choose another out=FILE") from None


def output_path(out: str, run: Run) -> tuple[Path, str]:
    """Where the predictions go and their format: `out` (by its suffix), else the run dir's default."""
    if not out:
        fmt = run.task.prediction_format
        return run.run_dir / f"predictions.{fmt}", fmt
    path = Path(out).expanduser()
    if path.suffix not in FORMATS:
        raise ConfigError(f"out={out}: give a .csv or .jsonl file")
    return path, FORMATS[path.suffix]


def task_class(ckpt: str) -> type[Task]:
    """The task class of the run `ckpt` names; one that makes no predictions is a one-line ConfigError."""
    name = run_config(ckpt)["task"]["name"]
    cls = TASKS.get(name)
    if cls.predict is Task.predict:
        raise ConfigError(f"ckpt={ckpt} is a '{name}' run, and that task makes no predictions")
    return cls


def _ckpt_of(argv: Sequence[str]) -> str:
    found = [a.partition("=")[2] for a in argv if a.startswith("ckpt=")]
    if not found or not found[0]:
        raise ArgumentError(f"ckpt= is required; {USAGE}", key="ckpt")
    return found[0]


def run(argv: list[str]) -> int:
    """The command: predict, write the file, print the one summary line."""
    cls = task_class(_ckpt_of(argv))
    values, overrides = parse_args(
        argv, {**fields_of(PredictOptions), **fields_of(cls.predict)}, usage=USAGE, sections=("task",)
    )
    opts = PredictOptions(**check(values, PredictOptions))
    task_options = check(values, cls.predict)
    require(values, ("input",), USAGE)
    loaded = load_run(opts.ckpt, device=opts.device, overrides=overrides, command="recipes.predict")
    out, fmt = output_path(opts.out, loaded)
    items = loaded.task.prediction_inputs(Path(opts.input).expanduser())
    rows = predict_items(loaded, items, batch_size=opts.batch_size, options=task_options)
    write_rows(out, rows, fmt)
    summary = loaded.task.prediction_summary(items, rows)
    print(json.dumps({"predictions": str(out), "rows": len(rows), **summary}), flush=True)
    return 0


def describe() -> str:
    """`--help`: the keys, and each task's own prediction options."""
    groups: list[tuple[str, Any]] = [("keys", PredictOptions)]
    for name in task_names():
        cls = TASKS.get(name)
        if cls.predict is not Task.predict:
            groups.append((f"{name} runs also take", cls.predict))
    doc = __doc__.split("\n\n", 1)[1].strip()
    doc += "\ntask.KEY=VALUE changes a task setting of the run, e.g. task.decoder=greedy (asr)."
    return help_text(USAGE, doc, groups)


main = command(run, usage=USAGE, describe=describe)

if __name__ == "__main__":
    sys.exit(main())
