"""`key=value` command-line arguments into a dataclass of options: the parser of the after-training commands
(generate, export)."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from core.errors import ConfigError

T = TypeVar("T")


def parse_key_values(argv: list[str], options: type[T], usage: str) -> T:
    """`options()` with the key=value arguments of `argv` set; an unknown key or bad value is a one-line
    ConfigError. Values are parsed by hand, not as YAML: a prompt like "1:1" or "yes" stays the text it is."""
    cfg = options()
    types = {f.name: f.type for f in dataclasses.fields(options)}  # type: ignore[arg-type]
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ConfigError(f"argument {arg!r} is not key=value; {usage}")
        if key not in types:
            raise ConfigError(f"unknown key {key!r}; valid keys: {', '.join(types)}")
        kind = {"int": int, "float": float}.get(types[key], str)
        try:
            setattr(cfg, key, kind(value))
        except ValueError:
            raise ConfigError(f"{key}={value!r} is not a valid {types[key]}") from None
    return cfg
