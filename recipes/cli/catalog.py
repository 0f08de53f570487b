"""What a command line can name, as data: the tasks, the models and data each task accepts, and every key of
a task's composed config with its default and a one-line doc. `recipes.list` and `recipes.train --help`
print it.

A key's doc lives beside its default: a `#:` comment above a dataclass field (`TrainConfig`, the trainer,
optim, compile and dist sections, `BadSamplePolicy`), or for a keyword of a registered model, dataset or task
a `name: text` line of the builder's docstring (the convention in core/registry.py).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from core.errors import ConfigError
from core.registry import DATASETS, MODELS, TASKS, Registry
from recipes.cli.config import CONF_DIR, TrainConfig, register_configs
from recipes.cli.errors import one_line
from recipes.cli.validate import check_pairing, usable_option

register_configs()

#: the config sections a registered builder fills, and how a command line picks the builder
BUILT_SECTIONS: dict[str, tuple[Registry, str]] = {
    "task": (TASKS, "the task: +task=NAME (python -m recipes.list tasks)"),
    "model": (MODELS, "the model: model=NAME (python -m recipes.list models --task TASK)"),
    "data": (DATASETS, "the dataset: data=NAME (python -m recipes.list data --task TASK)"),
}
# a builder docstring's keyword line: `name: text`
_KEYWORD_LINE = re.compile(r"(\w+): (\S.*)")


@dataclass(frozen=True)
class Key:
    """One key of a composed config: its dotted name, its value there, and its doc ("" when it has none)."""

    name: str
    default: Any
    doc: str


def task_names() -> list[str]:
    """The tasks a command line can pick with +task=NAME (conf/task/*.yaml), sorted."""
    return sorted(p.stem for p in (CONF_DIR / "task").glob("*.yaml"))


def check_task(name: str) -> None:
    """Raise ConfigError naming `name` and the valid tasks unless +task=`name` exists."""
    if name not in task_names() or name not in TASKS:
        raise ConfigError(f"unknown task '{name}'; valid choices: {', '.join(task_names())}")


def accepted(task: str, kind: str) -> list[str]:
    """The `kind` ("model" or "data") options task `task` can use, sorted: the one answer errors use too."""
    check_task(task)
    return TASKS.get(task).accepted(kind)


def summary(fn: Callable[..., Any]) -> str:
    """The first paragraph of a builder's docstring, on one line."""
    doc = inspect.cleandoc(fn.__doc__ or "")
    return " ".join(doc.split("\n\n")[0].split())


def config_keys(overrides: list[str]) -> list[Key]:
    """Every key of the run config composed from `overrides` (e.g. ["+task=lm"]), in the config's order,
    with its value there (interpolations unresolved) and its doc; a bad override is one ConfigError."""
    check_pairing(overrides)
    return _documented_keys(_composed("train", overrides))


def option_keys(kind: str, name: str) -> list[Key]:
    """Every key `kind=name` sets (conf/KIND/NAME.yaml over its builder's schema: a model preset's sizes),
    with its value and doc, then each input its builder takes from the task (a model's vocab_size and
    context) with the value TASK_INPUT; an unknown option is one ConfigError listing the shipped ones."""
    options = sorted(p.stem for p in (CONF_DIR / kind).glob("*.yaml"))
    check_option(kind, name, options, f"unknown {kind} '{name}'")
    keys = _documented_keys(_composed(f"{kind}/{name}", []))
    params = inspect.signature(BUILT_SECTIONS[kind][0].get(name)).parameters.values()
    inputs = [
        p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    return keys + [Key(f"{kind}.{n}", TASK_INPUT, "set by the task") for n in inputs]


def check_option(kind: str, name: str, valid: list[str], fault: str) -> None:
    """Raise ConfigError (`fault`, then the valid choices; key `kind`) unless `name` is one of `valid`."""
    if name not in valid:
        raise ConfigError(f"{fault}; valid choices: {', '.join(valid)}", key=kind, value=name, valid=valid)


#: the value `option_keys` gives a builder input the task supplies (not a key a command line sets)
TASK_INPUT = "(task)"


def _composed(config: str, overrides: list[str]) -> dict[str, Any]:
    """The config `config` (a conf/ path without .yaml) composed with `overrides`, interpolations
    unresolved; a composition failure is one ConfigError (the user's override)."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config, overrides=overrides)
    except Exception as e:
        raise ConfigError(one_line(e, keep=usable_option(overrides))) from None
    finally:
        GlobalHydra.instance().clear()
    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def _documented_keys(plain: dict[str, Any]) -> list[Key]:
    docs = key_docs(plain)
    return [Key(name, value, docs.get(name, "")) for name, value in _flatten(plain, "")]


def key_docs(plain: dict[str, Any]) -> dict[str, str]:
    """Dotted key -> doc for a composed config: the run schema's field docs, and the docs of the builders
    its task, model and data sections name."""
    docs = _section_docs(TrainConfig, "")
    for part, (reg, how) in BUILT_SECTIONS.items():
        section = plain.get(part)
        if isinstance(section, dict) and section.get("name") in reg:
            docs[f"{part}.name"] = how
            docs.update({f"{part}.{k}": v for k, v in builder_docs(reg.get(section["name"])).items()})
    return docs


def _section_docs(cls: type, prefix: str) -> dict[str, str]:
    """Dotted key -> doc for dataclass `cls` and the dataclasses its fields hold (a section's default, or
    the type of an optional entry such as `logger.wandb`), at any depth."""
    docs = {f"{prefix}{k}": v for k, v in field_docs(cls).items()}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = f.default_factory if isinstance(f.default_factory, type) else hints.get(f.name)
        inner = next((a for a in typing.get_args(inner) if dataclasses.is_dataclass(a)), inner)
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            docs.update(_section_docs(inner, f"{prefix}{f.name}."))
    return docs


def builder_docs(fn: Callable[..., Any]) -> dict[str, str]:
    """Doc of each config key a registered builder contributes: its keywords' `name: text` docstring lines,
    and the field docs of a dataclass-valued keyword (configs spell its fields flat, e.g. data.on_bad_sample).
    """
    params = inspect.signature(fn).parameters
    docs: dict[str, str] = {}
    for p in params.values():
        if dataclasses.is_dataclass(p.default):
            docs.update(field_docs(type(p.default)))
    target = getattr(fn, "__wrapped__", None)  # a preset: its target documents the keywords
    for obj in (fn, target):
        if obj is None:
            continue
        init = vars(obj).get("__init__") if inspect.isclass(obj) else None
        for text in (obj.__doc__, getattr(init, "__doc__", None)):
            docs.update({k: v for k, v in _keyword_lines(text or "").items() if k in params})
    return docs


def _keyword_lines(doc: str) -> dict[str, str]:
    out: dict[str, str] = {}
    current = None
    for line in inspect.cleandoc(doc).splitlines():
        m = _KEYWORD_LINE.fullmatch(line)
        if m:
            current = m.group(1)
            out[current] = m.group(2).strip()
        elif current and line[:1].isspace() and line.strip():
            out[current] += " " + line.strip()
        else:
            current = None
    return out


def field_docs(cls: type) -> dict[str, str]:
    """Field -> its `#:` comment lines (joined) in the source of dataclass `cls`."""
    names = {f.name for f in dataclasses.fields(cls)}
    docs: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        text = line.strip()
        if text.startswith("#:"):
            pending.append(text[2:].strip())
            continue
        m = re.match(r"(\w+)\s*:", text)
        if m and pending and m.group(1) in names:
            docs[m.group(1)] = " ".join(pending)
        pending = []
    return docs


def _flatten(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _flatten(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], node


def table(rows: list[tuple[str, ...]]) -> str:
    """Rows as aligned columns, two spaces apart (the last column unpadded), one row per line."""
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ("  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]) for r in rows)
    return "\n".join(line.rstrip() for line in lines)


def show(value: Any) -> str:
    """`value` as a command line gives it (`key=<this>` sets exactly this value)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{show(v)}" for k, v in value.items()) + "}"
    text = str(value)
    try:
        if text and _parsed(text) == text:
            return text
    except Exception:  # not a bare word to Hydra's override grammar: quote it
        pass
    return "'" + text.replace("'", "\\'") + "'"


def _parsed(text: str) -> Any:
    return _parser().parse_override(f"k={text}").value()


@functools.cache
def _parser() -> OverridesParser:
    return OverridesParser.create()
