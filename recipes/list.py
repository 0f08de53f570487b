"""What a command line can name: `python -m recipes.list [tasks|models|data|keys] [NAME ...] [--task T]
[key=value]`.

tasks: each task with its one-line doc. models, data: each option with the tasks that can use it and its doc;
with --task NAME only the options that task can use; with option NAMEs, every key each sets (a model
preset's sizes), a column per option. keys (needs --task): every key of that task's composed config, with
its default and doc; `key=value` group choices (e.g. model=vit) pick the parts whose keys show. A bad
argument is one line naming it and the valid choices, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from core.errors import ConfigError
from core.registry import DATASETS, MODELS, TASKS
from recipes.cli.catalog import (
    TASK_INPUT,
    Key,
    accepted,
    check_option,
    check_task,
    config_keys,
    option_keys,
    show,
    summary,
    table,
    task_names,
)
from recipes.cli.command import emit

SECTIONS = ("tasks", "models", "data", "keys")
USAGE = "python -m recipes.list [tasks|models|data|keys] [NAME ...] [--task NAME] [key=value ...]"


def tasks_table() -> str:
    """Each task a command line can pick, with its one-line doc."""
    return table([(name, summary(TASKS.get(name))) for name in task_names()])


def parts_table(kind: str, task: str | None = None) -> str:
    """The `kind` ("model" or "data") options with their docs: all of them with the tasks that can use each,
    or those `task` can use."""
    reg = MODELS if kind == "model" else DATASETS
    if task is not None:
        return table([(name, summary(reg.get(name))) for name in accepted(task, kind)])
    users = {t: set(accepted(t, kind)) for t in task_names()}
    return table(
        [
            (name, ",".join(t for t, ok in users.items() if name in ok) or "-", summary(reg.get(name)))
            for name in reg.names()
        ]
    )


def options_table(kind: str, names: Sequence[str], task: str | None = None) -> str:
    """Every key the `kind` options `names` set (conf/KIND/NAME.yaml over the builder's schema): a header row,
    then key, each option's value ("-": not its key; TASK_INPUT: the task's), doc."""
    for name in names if task is not None else ():
        check_option(kind, name, accepted(task, kind), f"{kind}={name} cannot be used by +task={task}")
    values = {name: {k.name: k for k in option_keys(kind, name)} for name in names}
    rows = [("key", *names, "doc")]
    for key in dict.fromkeys(k for keys in values.values() for k in keys):
        held = [keys[key] for keys in values.values() if key in keys]
        cells = [_cell(values[n].get(key)) for n in names]
        rows.append((key, *cells, next((k.doc for k in held if k.doc), "")))
    return table(rows)


def _cell(key: Key | None) -> str:
    if key is None:
        return "-"
    return key.default if key.default is TASK_INPUT else show(key.default)


def keys_table(task: str, overrides: Sequence[str] = ()) -> str:
    """Every key of the config `+task=task` and `overrides` compose: key, default, doc."""
    check_task(task)
    keys = config_keys([f"+task={task}", *overrides])
    return table([(k.name, show(k.default), k.doc) for k in keys])


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print the section asked for; a bad argument is one line, exit 2."""
    parser = _Parser(prog="python -m recipes.list", usage=USAGE, description=__doc__.split("\n\n")[1])
    parser.add_argument("section", nargs="?", default="tasks", choices=SECTIONS, help="what to list (tasks)")
    parser.add_argument("--task", help="only what this task accepts (keys: required)")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="models, data: option names to show the keys of; keys: choices such as model=vit",
    )
    try:
        args = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
        if args.task is not None:
            check_task(args.task)
        choices = [o for o in args.overrides if "=" in o]
        names = [o for o in args.overrides if "=" not in o]
        if choices and args.section != "keys":
            raise ConfigError(f"{' '.join(choices)}: key=value choices apply to keys only")
        if names and args.section not in ("models", "data"):
            raise ConfigError(f"{' '.join(names)}: option names apply to models and data only")
        kind = "model" if args.section == "models" else "data"
        if args.section == "tasks":
            text = tasks_table()
        elif args.section in ("models", "data"):
            text = options_table(kind, names, args.task) if names else parts_table(kind, args.task)
        elif args.task is None:
            raise ConfigError(f"keys needs --task NAME; valid choices: {', '.join(task_names())}")
        else:
            text = keys_table(args.task, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return emit(text)


if __name__ == "__main__":
    sys.exit(main())
