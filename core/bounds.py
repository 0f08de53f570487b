"""Valid values of config fields, declared beside their defaults: `x: Annotated[int, Bounds(ge=1)] = 4`.

One mechanism serves dataclass configs (TrainerConfig, OptimConfig, ...) and the keyword parameters of
registered builders (models, datasets, tasks), so a bad value is caught by the same code whether it comes
from a command line (checked before any work) or from Python. Every int must also fit in 64 bits: torch
stores sizes and seeds as int64, and a larger one fails deep inside it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import ConfigError

INT64_MAX = 2**63 - 1


class LazyChoices(Sequence[Any]):
    """A `Bounds(choices=...)` listed by `source` when first needed (a check, a listing, an error), not when
    the module declaring it is imported: for a library's own list whose import costs seconds of every
    process start, most of which never use that library (torchvision's architectures)."""

    def __init__(self, source: Callable[[], Iterable[Any]]) -> None:
        self._source = source

    @functools.cached_property
    def _values(self) -> tuple[Any, ...]:
        return tuple(self._source())

    def __getitem__(self, i: Any) -> Any:
        return self._values[i]

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"LazyChoices({self._source.__qualname__})"


@dataclass(frozen=True)
class Bounds:
    """A field's valid values: a range (ge/gt/le/lt), or `choices`; `also` lists values valid outside the
    range (e.g. -1 meaning "no limit"); for a list, `length` is its size and the rest applies to each item."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | LazyChoices = ()
    also: tuple[Any, ...] = ()
    length: int | None = None
    #: "dir" or "file": a given (non-empty) path must name an existing one. Data folders and manifests say
    #: so, and a sweep's every job is checked before the first starts (a missing folder of job 1 failed only
    #: when job 1 ran, after job 0 had trained)
    exists: str | None = None

    def describe(self) -> str:
        """The valid values in words, e.g. ">= 1", ">= 0 and < 1", "skip, abort", "-1 or >= 1"."""
        if self.exists:
            text = "an existing " + ("folder" if self.exists == "dir" else "file")
        elif self.choices:
            text = ", ".join(str(c) for c in self.choices)
        else:
            parts = [
                f"{op} {_num(v)}"
                for op, v in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
                if v is not None
            ]
            text = " and ".join(parts) or "any value"
        if self.also:
            text = " or ".join(str(a) for a in self.also) + " or " + text
        if self.length is not None:
            text = f"{self.length} values, each {text}"
        return text

    def admits(self, value: Any) -> bool:
        """Whether one (non-list) value is valid."""
        if value in self.also:
            return True
        if self.exists:
            if not isinstance(value, str) or not value:
                return True  # not given: the builder says it is required
            path = Path(value).expanduser()
            return path.is_dir() if self.exists == "dir" else path.is_file()
        if self.choices:
            return value in self.choices
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return True  # None and strings are the type checker's business, not a range's
        # written as "all conditions hold" so that NaN fails every range
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def check(self, key: str, value: Any) -> None:
        """Raise ConfigError naming `key`, `value` and the valid values unless `value` is valid."""
        items = value if isinstance(value, (list, tuple)) else None
        shown, valid = _show(value), self.valid()
        if self.length is not None and (items is None or len(items) != self.length):
            raise ConfigError(
                f"{key}={shown} is invalid; valid: {self.describe()}", key=key, value=shown, valid=valid
            )
        for v in items if items is not None else [value]:
            if not self.admits(v):
                why = "does not exist" if self.exists else "is unknown" if self.choices else "is out of range"
                raise ConfigError(
                    f"{key}={shown} {why}; valid: {self.describe()}", key=key, value=shown, valid=valid
                )

    def valid(self) -> tuple[str, ...]:
        """The valid values as an error's `valid` field: each choice (and each `also` value), or the range
        in words as one item."""
        if self.choices and self.length is None:
            return tuple(str(a) for a in self.also) + tuple(str(c) for c in self.choices)
        return (self.describe(),)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return str(value)


def bounds_of(target: Callable[..., Any] | type) -> dict[str, Bounds]:
    """Field or keyword name -> its Bounds, read from `Annotated` hints of a dataclass, a class's
    `__init__`, a function, or a registry preset (whose hints are its target's); a parameter whose default
    is a dataclass instance (a data builder's `BadSamplePolicy`) contributes its fields' bounds, flat, as
    configs spell them (core.registry.gather_flat_fields)."""
    fn = getattr(target, "__wrapped__", target)
    if inspect.isclass(fn) and not dataclasses.is_dataclass(fn):
        fn = fn.__init__
    out = {}
    for name, hint in typing.get_type_hints(fn, include_extras=True).items():
        for meta in getattr(hint, "__metadata__", ()):
            if isinstance(meta, Bounds):
                out[name] = meta
    if not dataclasses.is_dataclass(fn):
        for p in inspect.signature(target).parameters.values():
            if dataclasses.is_dataclass(p.default):
                out.update(bounds_of(type(p.default)))
    return out


def check_values(prefix: str, values: Mapping[str, Any], target: Callable[..., Any] | type) -> None:
    """Check every value of a config section against `target`'s Bounds and the int64 range; the first bad
    one raises ConfigError naming `prefix.key`."""
    bounds = bounds_of(target)
    for key, value in values.items():
        full = f"{prefix}.{key}" if prefix else key
        check_int64(full, value)
        if key in bounds:
            bounds[key].check(full, value)


def check_int64(key: str, value: Any) -> None:
    """Raise ConfigError if `value` (or an item of it) is an int outside int64 or an infinite float."""
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT64_MAX:
            raise ConfigError(
                f"{key}={_show(value)} is too large: integers must be within +-{INT64_MAX}",
                key=key,
                value=_show(value),
                valid=(f"within +-{INT64_MAX}",),
            )
        if isinstance(v, float) and math.isinf(v):
            raise ConfigError(
                f"{key}={_show(value)} is infinite; give a finite number",
                key=key,
                value=_show(value),
                valid=("a finite number",),
            )
