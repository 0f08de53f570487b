"""Reward functions for RL with verifiable rewards (`+task=grpo`): the built-in checks, a user's own named
as `module:function`, and scoring a group of completions with every reward, one line naming the reward and
the prompt where a reward misbehaves.

The contract, TRL's: a reward is called as `reward(prompts, completions, **fields)`, where `prompts` and
`completions` are lists of one length (the prompt repeated for each of its completions; a prompt is the text
or the message list of the JSONL row), each of `fields` a list of that length holding the row's other keys
(e.g. `answer`), and it returns one float per completion. A reward named on the command line or in the
config is imported from the Python path; nothing named in a checkpoint or a downloaded folder is imported.
"""

from __future__ import annotations

import functools
import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from core.errors import ConfigError, DataError

Reward = Callable[..., Sequence[float]]

#: a number as the number check reads it: an optional sign, digits with optional thousands commas, an
#: optional decimal part (math-verify is not a dependency: this is the stated parser)
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")


def last_number(text: str) -> float | None:
    """The last number written in `text` (`NUMBER`: commas between thousands dropped), or None."""
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def exact_match(
    prompts: Sequence[Any], completions: Sequence[str], *, field: str = "answer", **fields: Any
) -> list[float]:
    """1.0 where a completion, stripped, is the row's `field` (stripped) word for word, else 0.0."""
    answers = _field(fields, field)
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers, strict=True)]


def number_match(
    prompts: Sequence[Any], completions: Sequence[str], *, field: str = "answer", **fields: Any
) -> list[float]:
    """1.0 where the last number in a completion equals the row's `field` (a number, or the last number in
    its text) within 1e-6 relative, else 0.0 (no number: 0.0)."""
    out = []
    for c, a in zip(completions, _field(fields, field), strict=True):
        want = float(a) if isinstance(a, (int, float)) else last_number(str(a))
        got = last_number(c)
        out.append(float(want is not None and got is not None and math.isclose(got, want, rel_tol=1e-6)))
    return out


def format_match(
    prompts: Sequence[Any], completions: Sequence[str], *, pattern: str = "", **fields: Any
) -> list[float]:
    """1.0 where the whole completion (stripped) matches the regular expression `pattern`, else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]


def length_penalty(
    prompts: Sequence[Any], completions: Sequence[str], *, limit: int = 0, **fields: Any
) -> list[float]:
    """0.0 for a completion of at most `limit` characters, falling linearly to -1.0 at twice `limit` (and
    staying there): DAPO's soft overlong penalty, counted in characters."""
    if limit <= 0:
        return [0.0] * len(completions)
    return [-min(1.0, max(0, len(c) - limit) / limit) for c in completions]


#: the built-in rewards by the name `task.rewards` gives them
BUILTIN: dict[str, Reward] = {
    "exact_match": exact_match,
    "number": number_match,
    "format": format_match,
    "length": length_penalty,
}


def _field(fields: dict[str, Any], name: str) -> Sequence[Any]:
    if name not in fields:
        raise DataError(
            f"the prompts carry no '{name}' field for the reward to check against; add it to each JSONL row "
            "or set task.answer_field",
            key="task.answer_field",
            value=name,
            valid=tuple(sorted(fields)),
        )
    return fields[name]


def resolve(name: str, options: dict[str, Any]) -> Reward:
    """The reward `name` names: a built-in one (given its `options`: field, pattern, limit) or a user's
    `module:function`, imported here; anything else is a one-line ConfigError listing the built-in ones."""
    if name in BUILTIN:
        fn = BUILTIN[name]
        keys = {"exact_match": ("field",), "number": ("field",), "format": ("pattern",), "length": ("limit",)}
        return functools.partial(fn, **{k: options[k] for k in keys[name]})
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(
            f"task.rewards: unknown reward {name!r}; built-in: {', '.join(BUILTIN)}, or module:function",
            key="task.rewards",
            value=name,
            valid=(*BUILTIN, "module:function"),
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"task.rewards: cannot import {name} ({type(e).__name__}: {e}); the module must be on the Python "
            "path",
            key="task.rewards",
            value=name,
        ) from None
    if not callable(fn):
        raise ConfigError(f"task.rewards: {name} is not a function", key="task.rewards", value=name)
    return fn


def score_group(
    rewards: Sequence[tuple[str, Reward]],
    prompt: Any,
    completions: Sequence[str],
    fields: dict[str, Any],
    index: int,
) -> torch.Tensor:
    """Each reward of each of `completions` of one prompt (dataset index `index`), (completions, rewards)
    float64; a reward that raises, gives the wrong count or a non-finite value is a one-line DataError
    naming it and the prompt."""
    n = len(completions)
    columns = {k: [v] * n for k, v in fields.items()}
    out = torch.zeros(n, len(rewards), dtype=torch.float64)
    for j, (name, fn) in enumerate(rewards):
        where = f"reward {name} on prompt {index}"
        try:
            values = list(fn([prompt] * n, list(completions), **columns))
        except DataError:
            raise
        except Exception as e:  # a user's code: any failure is the reward's, named with its prompt
            raise DataError(
                f"{where} raised {type(e).__name__}: {e}", key="task.rewards", value=name
            ) from None
        if len(values) != n:
            raise DataError(
                f"{where} returned {len(values)} values for {n} completions", key="task.rewards", value=name
            )
        try:
            column = torch.tensor([float(v) for v in values], dtype=torch.float64)
        except (TypeError, ValueError):
            raise DataError(
                f"{where} returned a value that is not a number", key="task.rewards", value=name
            ) from None
        if not torch.isfinite(column).all():
            raise DataError(f"{where} returned a non-finite value", key="task.rewards", value=name)
        out[:, j] = column
    return out
