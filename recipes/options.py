"""The command line of the commands that use a finished run (eval, predict, generate, transcribe).

Each takes `key=value` arguments: the keys of its options dataclass, the keyword options of the run's task
(e.g. `Task.predict`'s `top_k`), and `SECTION.KEY=VALUE` overrides of the run's saved config
(`recipes.runs.apply_overrides`). Values are taken as written (a prompt such as "1:1" stays text) and
converted to the option's type; each is checked against its `Bounds` (core.bounds). An unknown key, a bad
value or an unreadable input is one line on stderr and exit 2, never a traceback.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from core.bounds import check_values
from core.errors import ConfigError, TorchkilnError
from core.workers import report_failures
from recipes.catalog import builder_docs, field_docs, show
from recipes.list import emit, table

#: an option's (type, default), by name
Fields = dict[str, tuple[type, Any]]
_BOOLS = {"true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}


def fields_of(target: type | Callable[..., Any]) -> Fields:
    """The options a dataclass (its fields) or a function (its keyword-only parameters with defaults)
    declares, in order, with the type each value is converted to."""
    hints = typing.get_type_hints(target)
    if dataclasses.is_dataclass(target):
        return {f.name: (hints[f.name], f.default) for f in dataclasses.fields(target)}
    params = inspect.signature(target).parameters.values()
    return {p.name: (hints[p.name], p.default) for p in params if p.kind is p.KEYWORD_ONLY}


def parse_args(
    argv: Sequence[str], fields: Fields, *, usage: str, sections: Sequence[str] = ()
) -> tuple[dict[str, Any], list[str]]:
    """(each option's value, its default unless given; the `SECTION.KEY=VALUE` overrides for `sections`, as
    written); a malformed argument, an unknown or repeated key or a value of the wrong type is a one-line
    ConfigError."""
    values = {name: default for name, (_, default) in fields.items()}
    overrides: list[str] = []
    seen: set[str] = set()
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ConfigError(f"argument {arg!r} is not key=value; {usage}")
        if key in seen:
            raise ConfigError(f"{key} is given twice; give it once")
        seen.add(key)
        section, dot, rest = key.partition(".")
        if dot and rest and section in sections:
            overrides.append(arg)
        elif key in fields:
            values[key] = _convert(key, value, fields[key][0])
        else:
            valid = [*fields, *(f"{s}.KEY" for s in sections)]
            raise ConfigError(f"unknown key {key!r}; valid keys: {', '.join(valid)}")
    return values, overrides


def _convert(key: str, value: str, kind: type) -> Any:
    try:
        if kind is bool:
            return _BOOLS[value.lower()]
        return kind(value) if kind in (int, float) else value
    except (KeyError, ValueError):
        raise ConfigError(f"{key}={value!r} is not a valid {kind.__name__}") from None


def check(values: Mapping[str, Any], target: type | Callable[..., Any]) -> dict[str, Any]:
    """The values of `target`'s options (`fields_of`) among `values`, checked against their `Bounds`."""
    mine = {k: v for k, v in values.items() if k in fields_of(target)}
    check_values("", mine, target)
    return mine


def help_text(usage: str, doc: str, groups: Sequence[tuple[str, type | Callable[..., Any]]]) -> str:
    """`--help`: the usage line, the command's one-paragraph `doc`, then each group's options (title, a
    dataclass or a task's method) as key, default, doc."""
    parts = [usage, "", doc]
    for title, target in groups:
        docs = field_docs(target) if dataclasses.is_dataclass(target) else builder_docs(target)
        rows = [(k, show(d), docs.get(k, "")) for k, (_, d) in fields_of(target).items()]
        if rows:
            parts += ["", f"{title}:", table(rows)]
    return "\n".join(parts)


def command(
    body: Callable[[list[str]], int], *, usage: str, describe: Callable[[], str]
) -> Callable[[list[str] | None], int]:
    """A CLI entry `main(argv)`: `-h`/`--help` prints `describe()` (exit 0), no argument prints `usage` (exit
    2), else `body(argv)`, with a user's mistake (a TorchkilnError, one raised in a DataLoader worker too) as
    one line `error: ...` on stderr and its exit code (2 unless the error says otherwise)."""

    def main(argv: list[str] | None = None) -> int:
        argv = sys.argv[1:] if argv is None else argv
        if any(a in ("-h", "--help") for a in argv):
            return emit(describe())
        if not argv:
            print(usage, file=sys.stderr)
            return 2
        try:
            with report_failures():
                return body(argv)
        except TorchkilnError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return getattr(e, "exit_code", 2)

    return main
