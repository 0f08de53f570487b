"""The `key=value` arguments of the commands that use a finished run (eval, predict, generate, transcribe,
export, detect): one parser for all of them.

Each takes the keys of its options dataclass, where it has them the keyword options of the run's task (e.g.
`Task.predict`'s `top_k`), and `SECTION.KEY=VALUE` overrides of the run's saved config
(`recipes.cli.runs.apply_overrides`). Values are taken as written, not as YAML (a prompt such as "1:1" or
"yes" stays text), and converted to the option's type: int, float, bool (true/false, yes/no, 1/0), str or
Path; each is checked against its `Bounds` (core.bounds). A malformed argument, an unknown or repeated key,
a value of the wrong type or out of range is an `ArgumentError` (a ConfigError: one line, exit 2) that names
the key and value and lists what is valid.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from core.bounds import bounds_of, check_int64
from core.errors import ConfigError
from recipes.cli.catalog import builder_docs, field_docs, show, table

T = TypeVar("T")
#: an option's (type, default), by name
Fields = dict[str, tuple[Any, Any]]
_BOOLS = {"true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}


class ArgumentError(ConfigError):
    """A `key=value` argument that cannot be used, its `key`, `value` and `valid` fields as
    `core.errors.TorchkilnError` defines them (`key` is the whole argument when it has no `=`, `value`
    None, `valid` the form KEY=VALUE)."""


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
    written); a malformed argument, an unknown or repeated key or a value of the wrong type is an
    ArgumentError."""
    values = {name: default for name, (_, default) in fields.items()}
    overrides: list[str] = []
    seen: dict[str, str] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ArgumentError(f"argument {arg!r} is not key=value; {usage}", key=arg, valid=("KEY=VALUE",))
        if key in seen:
            raise ArgumentError(
                f"{key} is given twice ({key}={seen[key]}, {key}={value}); give it once", key=key, value=value
            )
        seen[key] = value
        section, dot, rest = key.partition(".")
        if dot and rest and section in sections:
            overrides.append(arg)
        elif key in sections and key not in fields:
            overrides.append(f"{key}.name={value}")  # Hydra's group syntax: data=text_files picks the dataset
        elif key in fields:
            values[key] = convert(key, value, fields[key][0])
        else:
            valid = [*fields, *(f"{s}.KEY" for s in sections)]
            raise ArgumentError(
                f"unknown key {key!r}; valid keys: {', '.join(valid)}", key=key, value=value, valid=valid
            )
    return values, overrides


def convert(key: str, value: str, kind: Any) -> Any:
    """`value` as the type `kind` (int, float, bool, str, Path, or one of them or None: "null" is None); a
    value that is not one is an ArgumentError."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        choices = [k for k in typing.get_args(kind) if k is not type(None)]
        if value.lower() in ("null", "none"):
            return None
        kind = choices[0] if len(choices) == 1 else str
    try:
        if kind is bool:
            return _BOOLS[value.lower()]
        if kind in (int, float):
            return kind(value)
        if kind is Path:
            return Path(value).expanduser()
        return value
    except (KeyError, ValueError):
        name = getattr(kind, "__name__", str(kind))
        valid = ("true", "false", "yes", "no", "1", "0") if kind is bool else ()
        hint = f"; valid: {', '.join(valid)}" if valid else ""
        why = f"{key}={value!r} is not a valid {name}{hint}"
        raise ArgumentError(why, key=key, value=value, valid=valid) from None


def check(values: Mapping[str, Any], target: type | Callable[..., Any]) -> dict[str, Any]:
    """The values of `target`'s options (`fields_of`) among `values`, each checked against its `Bounds` and
    the int64 range; the first that is out of range is an ArgumentError naming it."""
    bounds = bounds_of(target)
    mine = {k: v for k, v in values.items() if k in fields_of(target)}
    for key, value in mine.items():
        try:
            check_int64(key, value)
            if key in bounds:
                bounds[key].check(key, value)
        except ArgumentError:
            raise
        except ConfigError as e:
            raise ArgumentError(str(e), key=key, value=show(value), valid=e.valid) from None
    return mine


def require(values: Mapping[str, Any], keys: Sequence[str], usage: str) -> None:
    """An ArgumentError naming the first of `keys` that has no value (the command cannot run without it)."""
    for key in keys:
        if not values[key]:
            needed = " and ".join(f"{k}=" for k in keys)
            raise ArgumentError(f"{needed} {'is' if len(keys) == 1 else 'are'} required; {usage}", key=key)


def parse_options(argv: Sequence[str], options: type[T], *, usage: str, required: Sequence[str] = ()) -> T:
    """`options()` (a dataclass) with the `key=value` arguments of `argv` set, converted and checked, and
    the `required` keys given; else an ArgumentError."""
    values, _ = parse_args(argv, fields_of(options), usage=usage)
    require(values, required, usage)
    return options(**check(values, options))


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
