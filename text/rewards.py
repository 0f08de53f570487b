"""Reward functions for RL with verifiable rewards (`+task=grpo`): the built-in checks, a user's own named
as `module:function`, and scoring a group of completions with every reward, one line naming the reward and
the prompt where a reward misbehaves.

The contract, TRL's `GRPOTrainer`'s, so a reward written for TRL (TRL's own `trl.rewards` included) runs
unchanged: a reward is called with keywords, `reward(prompts=..., completions=..., completion_ids=...,
trainer_state=..., **fields)`, each a list with one entry per completion: `prompts` the row's prompt
repeated for each of its completions (the text or the message list of the JSONL row), `completions` the
completion's text where the prompt is a text, or a list of one assistant message
(`[{"role": "assistant", "content": text}]`) where it is a message list, `completion_ids` the sampled
token ids (the end of turn included where the completion reached it), each of `fields` the row's other
keys (e.g. `answer`); `trainer_state` (one object) has TRL's `global_step`, `max_steps` and `epoch`. It
returns one float per completion (an `async def` reward: once awaited), or None where the reward does not
apply (a multi-task set: each reward scores its own rows): the weighted sum is over the rewards that
apply, and a completion no reward applies to has advantage 0 and is left out of its group's statistics,
as in TRL. A reward named on the command line or in the config is imported from the Python path; nothing
named in a checkpoint or a downloaded folder is imported.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.errors import ConfigError, DataError

Reward = Callable[..., Sequence[float | None]]
#: a completion as a reward receives it: a text, or (a conversational prompt's) a list of one message
Completion = str | Sequence[dict[str, Any]]

#: a number as the number check reads it: an optional sign, digits with optional thousands commas, an
#: optional decimal part (math-verify is not a dependency: this is the stated parser)
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")


#: the keywords every reward is called with; a prompt row may not use them as field names
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state")


@dataclass(frozen=True)
class RewardState:
    """Where the run is, as a reward's `trainer_state` keyword gives it: TRL's TrainerState names."""

    #: optimizer steps taken so far
    global_step: int = 0
    #: the run's last step
    max_steps: int = 0
    #: the epoch the step is in (from 0)
    epoch: int = 0


def completion_text(completion: Completion) -> str:
    """A completion as rewards receive it (a text, or the message list of a conversational prompt's), as
    text: its last message's content."""
    return completion if isinstance(completion, str) else str(completion[-1]["content"])


def last_number(text: str) -> float | None:
    """The last number written in `text` (`NUMBER`: commas between thousands dropped), or None."""
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def exact_match(
    prompts: Sequence[Any], completions: Sequence[Completion], *, field: str = "answer", **fields: Any
) -> list[float]:
    """1.0 where a completion, stripped, is the row's `field` (stripped) word for word, else 0.0."""
    answers = _field(fields, field)
    texts = map(completion_text, completions)
    return [float(c.strip() == str(a).strip()) for c, a in zip(texts, answers, strict=True)]


def number_match(
    prompts: Sequence[Any], completions: Sequence[Completion], *, field: str = "answer", **fields: Any
) -> list[float]:
    """1.0 where the last number in a completion equals the row's `field` (a number, or the last number in
    its text) within 1e-6 relative, else 0.0 (no number: 0.0)."""
    out = []
    for c, a in zip(completions, _field(fields, field), strict=True):
        want = float(a) if isinstance(a, (int, float)) else last_number(str(a))
        got = last_number(completion_text(c))
        out.append(float(want is not None and got is not None and math.isclose(got, want, rel_tol=1e-6)))
    return out


def format_match(
    prompts: Sequence[Any], completions: Sequence[Completion], *, pattern: str = "", **fields: Any
) -> list[float]:
    """1.0 where the whole completion (stripped) matches the regular expression `pattern`, else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(completion_text(c).strip()) is not None) for c in completions]


def length_penalty(
    prompts: Sequence[Any], completions: Sequence[Completion], *, limit: int = 0, **fields: Any
) -> list[float]:
    """0.0 for a completion of at most `limit` characters, falling linearly to -1.0 at twice `limit` (and
    staying there): DAPO's soft overlong penalty, counted in characters."""
    if limit <= 0:
        return [0.0] * len(completions)
    return [-min(1.0, max(0, len(completion_text(c)) - limit) / limit) for c in completions]


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
            valid=tuple(sorted(k for k in fields if k not in RESERVED)),
        )
    return fields[name]


def resolve(name: str, options: dict[str, Any]) -> Reward:
    """The reward `name` names: a built-in one (given its `options`: field, pattern, limit), a user's
    `module:function`, imported here, or the path of a reward model's folder (`text.reward_model`); anything
    else is a one-line ConfigError listing the built-in ones."""
    if name in BUILTIN:  # before a folder of the same name in the working directory
        fn = BUILTIN[name]
        keys = {"exact_match": ("field",), "number": ("field",), "format": ("pattern",), "length": ("limit",)}
        return functools.partial(fn, **{k: options[k] for k in keys[name]})
    if Path(name).expanduser().is_dir():
        from text.reward_model import RewardModel

        return RewardModel(name)
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(
            f"task.rewards: unknown reward {name!r}; built-in: {', '.join(BUILTIN)}, or module:function, or "
            "a reward model's folder",
            key="task.rewards",
            value=name,
            valid=(*BUILTIN, "module:function", "FOLDER"),
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


def resolve_all(names: Sequence[str], options: dict[str, Any]) -> list[tuple[str, Reward]]:
    """(name, function) of each reward `names` names (`resolve`); a reward model is named by its folder's
    name, as TRL logs it, unless two share it (then by the path given)."""
    resolved = [(name, resolve(name, options)) for name in names]
    short = [getattr(fn, "folder_name", name) for name, fn in resolved]
    return [(s if short.count(s) == 1 else name, fn) for s, (name, fn) in zip(short, resolved, strict=True)]


def score_group(
    rewards: Sequence[tuple[str, Reward]],
    prompt: Any,
    completions: Sequence[str],
    fields: dict[str, Any],
    index: int,
    *,
    completion_ids: Sequence[Sequence[int]],
    state: RewardState | None = None,
) -> torch.Tensor:
    """Each reward of each of `completions` (texts, sampled as `completion_ids`) of one prompt (dataset
    index `index`), (completions, rewards) float64, NaN where a reward returned None (it does not apply);
    a reward that raises, gives the wrong count, a non-finite value or one that is not a number is a
    one-line DataError naming it and the prompt."""
    n = len(completions)
    if isinstance(prompt, str):
        given: list[Any] = list(completions)
    else:  # a conversational prompt's completions are assistant messages, as TRL gives them
        given = [[{"role": "assistant", "content": c}] for c in completions]
    columns = {k: [v] * n for k, v in fields.items()}
    kwargs = {
        "prompts": [prompt] * n,
        "completions": given,
        "completion_ids": [list(ids) for ids in completion_ids],
        "trainer_state": state or RewardState(),
    }
    out = torch.zeros(n, len(rewards), dtype=torch.float64)
    for j, (name, fn) in enumerate(rewards):
        where = f"reward {name} on prompt {index}"
        try:
            got = fn(**kwargs, **columns)
            # an async reward (TRL runs those concurrently; here one after another, per prompt)
            values = list(asyncio.run(got) if inspect.isawaitable(got) else got)
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
            column = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)
        except (TypeError, ValueError):
            raise DataError(
                f"{where} returned a value that is not a number", key="task.rewards", value=name
            ) from None
        given_values = torch.tensor([v is not None for v in values])
        if not torch.isfinite(column[given_values]).all():
            raise DataError(f"{where} returned a non-finite value", key="task.rewards", value=name)
        out[:, j] = column
    return out


def weighted_total(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted sum (N,) of each completion's rewards `scores` (N, rewards) over those that apply
    (not NaN); NaN for a completion none applies to (TRL's nansum, unscorable rows NaN)."""
    applied = ~torch.isnan(scores)
    total = (scores.nan_to_num(0.0) * weights).sum(dim=1)
    return total.masked_fill(~applied.any(dim=1), math.nan)
