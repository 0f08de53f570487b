"""Name -> builder registries, so configs pick models and datasets by name (timm-style).

A builder's docstring opens with a one-line summary and documents each keyword a config may set on a line
`name: text` of its own (continued on deeper-indented lines; a class: in its `__init__` docstring), which
`python -m recipes.list keys` prints beside the key.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from core.bounds import check_values
from core.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of builders; `build(name, **kwargs)` fails with the list of valid names."""

    def __init__(self, kind: str) -> None:
        """Create an empty registry; `kind` names it in error messages (e.g. "model")."""
        self.kind = kind
        self._builders: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator that registers a builder under `name`."""

        def deco(fn: Callable[..., T]) -> Callable[..., T]:
            if name in self._builders:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._builders[name] = fn
            return fn

        return deco

    def register_preset(self, name: str, target: Callable[..., T], doc: str, **defaults: Any) -> None:
        """Register `target` (a class or builder) under `name` with these keyword defaults, e.g. the sizes
        of one model family: its signature (and so its config schema) shows them, and a config overrides any.
        """
        sig = inspect.signature(target)
        unknown = sorted(set(defaults) - set(sig.parameters))
        if unknown:
            raise ConfigError(
                f"{self.kind} preset '{name}': {target.__name__} takes no {', '.join(unknown)}",
                key=f"{self.kind}.{unknown[0]}",
                value=str(defaults[unknown[0]]),
                valid=tuple(sig.parameters),
            )

        def preset(**kwargs: Any) -> T:
            return target(**{**defaults, **kwargs})

        params = [p.replace(default=defaults.get(p.name, p.default)) for p in sig.parameters.values()]
        preset.__signature__ = sig.replace(parameters=params, return_annotation=target)  # type: ignore[attr-defined]
        preset.__doc__, preset.__wrapped__ = doc, target  # type: ignore[attr-defined]
        preset.__name__ = preset.__qualname__ = name
        self.register(name)(preset)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._builders)

    def __contains__(self, name: object) -> bool:
        return name in self._builders

    def get(self, name: str) -> Callable[..., T]:
        """The builder for `name`, or a ConfigError listing the valid names."""
        try:
            return self._builders[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.kind} '{name}'; valid choices: {', '.join(self.names())}",
                key=self.kind,
                value=str(name),
                valid=self.names(),
            ) from None

    def build_section(self, section: Mapping[str, Any], **extra: Any) -> T:
        """Build from a config section: its `name`, its other keys as keywords, plus `extra`."""
        kwargs = {k: v for k, v in section.items() if k != "name"}
        return self.build(str(section.get("name", "")), **kwargs, **extra)

    def check_section(self, section: Mapping[str, Any]) -> None:
        """Fail now, listing the valid names, when a config section names nothing registered here, or when its
        values for a dataclass-valued parameter (e.g. a data policy) are invalid."""
        fn = self.get(str(section.get("name", "")))
        gather_flat_fields(fn, {k: v for k, v in section.items() if k != "name"})

    def build(self, name: str, **kwargs: Any) -> T:
        """Build `name` with keyword arguments; bad keywords become a ConfigError naming them."""
        fn = self.get(name)
        kwargs = gather_flat_fields(fn, kwargs)
        check_values(self.kind, kwargs, fn)
        try:
            return fn(**kwargs)
        except TypeError as e:
            if "unexpected keyword" in str(e) or "missing" in str(e):
                # Python names the argument: "got an unexpected keyword argument 'heads'", "missing 1
                # required positional argument: 'x'"
                arg = re.search(r"argument:? '(\w+)'", str(e))
                raise ConfigError(
                    f"{self.kind} '{name}': {e}",
                    key=f"{self.kind}.{arg.group(1)}" if arg else self.kind,
                    value=str(kwargs[arg.group(1)]) if arg and arg.group(1) in kwargs else None,
                    valid=tuple(inspect.signature(fn).parameters),
                ) from None
            raise


def gather_flat_fields(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with the fields of each parameter whose default is a dataclass instance gathered into that
    parameter: configs spell such fields flat (`data.on_bad_sample`, not `data.policy.on_bad_sample`)."""
    out = dict(kwargs)
    for p in inspect.signature(fn).parameters.values():
        if dataclasses.is_dataclass(p.default) and p.name not in out:
            names = {f.name for f in dataclasses.fields(p.default)}
            given = {k: out.pop(k) for k in list(out) if k in names}
            if given:
                out[p.name] = dataclasses.replace(p.default, **given)
    return out


#: Global tables the domains register into at import; names must be unique across domains.
MODELS: Registry = Registry("model")
DATASETS: Registry = Registry("data")
TASKS: Registry = Registry("task")


def with_model_keywords(
    build: Callable[..., Any], model: type, config: type | None = None
) -> Callable[..., Any]:
    """`build` (its own keywords, then `**settings` for `model`, or for the `config` dataclass `model` takes)
    given the signature, type hints and key docs of both: what the registry derives config schemas, bounds
    and `recipes.list keys` from."""
    sizes = model.__init__ if config is None else config  # a dataclass documents its fields in its docstring
    own = [p for p in inspect.signature(build).parameters.values() if p.kind is p.KEYWORD_ONLY]
    params = [*own, *inspect.signature(config or model).parameters.values()]
    build.__signature__ = inspect.Signature(params, return_annotation=model)  # type: ignore[attr-defined]
    hints = typing.get_type_hints(sizes, include_extras=True)
    hints |= typing.get_type_hints(build, include_extras=True)
    build.__annotations__ = {k: v for k, v in hints.items() if k in {p.name for p in params}}
    docs = (inspect.cleandoc(f.__doc__ or "") for f in (build, sizes))
    build.__doc__ = "\n\n".join(docs)
    return build
