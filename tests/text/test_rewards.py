"""Reward functions for +task=grpo (text/rewards.py): the built-in checks' values, the stated number parser,
a user's `module:function`, and a reward that raises, gives the wrong count or a non-finite value or
is unknown: one typed error naming the reward (and the prompt), which the CLI prints as one line, exit 2."""

from __future__ import annotations

import math
from typing import Any

import pytest

from core.errors import ConfigError, DataError
from text import rewards as rw

OPTIONS = {"field": "answer", "pattern": r"<answer>\w+</answer>", "limit": 4}


def test_the_built_in_rewards() -> None:
    completions = [" cba ", "abc", "<answer>cba</answer>", "cba and more"]
    answers = ["cba"] * 4
    assert rw.resolve("exact_match", OPTIONS)([None] * 4, completions, answer=answers) == [1, 0, 0, 0]
    assert rw.resolve("format", OPTIONS)([None] * 4, completions, answer=answers) == [0, 0, 1, 0]
    # 0 up to `limit` characters, then -1 at twice it: 3 -> 0, 12 -> -1, 5 -> -0.25
    assert rw.resolve("length", OPTIONS)([None] * 3, ["abc", "x" * 12, "abcde"]) == [0.0, -1.0, -0.25]


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("3 + 4 = 7", "7", 1.0),
        ("the answer is 1,234.", 1234, 1.0),
        ("first 7 then 8", "7", 0.0),  # the last number counts
        ("-0.5", "#### -.5", 1.0),  # an answer's text: its last number
        ("no number", "7", 0.0),
        ("7.000001", 7, 1.0),  # within 1e-6 relative
        ("7.01", 7, 0.0),
    ],
)
def test_the_number_check_compares_the_last_number(completion: str, answer: Any, reward: float) -> None:
    assert rw.number_match([None], [completion], answer=[answer]) == [reward]


def test_last_number_parses_signs_commas_and_decimals() -> None:
    assert rw.last_number("x -12,345.5 y") == -12345.5
    assert rw.last_number("+.25") == 0.25
    assert rw.last_number("none") is None


def doubled(prompts: list[Any], completions: list[str], **fields: Any) -> list[float]:
    """A user reward: twice the completion's length."""
    return [2.0 * len(c) for c in completions]


def raising(prompts: list[Any], completions: list[str], **fields: Any) -> list[float]:
    raise KeyError("oops")


def short(prompts: list[Any], completions: list[str], **fields: Any) -> list[float]:
    return [1.0]


def nan(prompts: list[Any], completions: list[str], **fields: Any) -> list[float]:
    return [math.nan] * len(completions)


def test_a_users_reward_gets_the_prompt_completions_and_fields() -> None:
    seen: dict[str, Any] = {}

    def spy(prompts: list[Any], completions: list[str], **fields: Any) -> list[float]:
        seen.update(prompts=prompts, completions=completions, fields=fields)
        return [0.5] * len(completions)

    out = rw.score_group(
        [("mine", rw.resolve("tests.text.test_rewards:doubled", OPTIONS)), ("spy", spy)],
        "Reverse abc",
        ["ab", "abcd"],
        {"answer": "cba", "level": 2},
        index=7,
    )
    assert out.tolist() == [[4.0, 0.5], [8.0, 0.5]]
    assert seen == {
        "prompts": ["Reverse abc"] * 2,
        "completions": ["ab", "abcd"],
        "fields": {"answer": ["cba"] * 2, "level": [2, 2]},
    }


@pytest.mark.parametrize("name", ["raising", "short", "nan"])
def test_a_bad_reward_is_a_data_error_naming_it_and_the_prompt(name: str) -> None:
    spec = f"tests.text.test_rewards:{name}"
    with pytest.raises(DataError) as e:
        rw.score_group([(spec, rw.resolve(spec, OPTIONS))], "p", ["a", "b"], {}, index=11)
    assert e.value.key == "task.rewards" and e.value.value == spec
    assert "prompt 11" in str(e.value)


def test_unknown_or_unimportable_rewards_are_config_errors() -> None:
    with pytest.raises(ConfigError) as e:
        rw.resolve("exact", OPTIONS)
    assert e.value.key == "task.rewards" and e.value.value == "exact"
    assert set(rw.BUILTIN) <= set(e.value.valid)
    with pytest.raises(ConfigError) as e:
        rw.resolve("tests.text.no_such_module:f", OPTIONS)
    assert e.value.value == "tests.text.no_such_module:f"


def test_a_missing_answer_field_is_a_data_error_naming_the_key() -> None:
    with pytest.raises(DataError) as e:
        rw.score_group([("exact_match", rw.resolve("exact_match", OPTIONS))], "p", ["a"], {"other": 1}, 0)
    assert e.value.key == "task.answer_field" and e.value.value == "answer"


def test_the_toy_tasks_letters_in_place_reward() -> None:
    from text.prompts import letters_in_place

    got = letters_in_place([None] * 4, ["cba", " cbx ", "abc", "cbaa"], answer=["cba"] * 4)
    assert got == [1.0, 2 / 3, 1 / 3, 3 / 4]  # the longer of the two counts, so extra letters cost
