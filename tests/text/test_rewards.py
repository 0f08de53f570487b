"""Reward functions for +task=grpo (text/rewards.py): the built-in checks' values, the stated number parser,
a user's `module:function`, and a reward that raises, gives the wrong count or a non-finite value or
is unknown: one typed error naming the reward (and the prompt), which the CLI prints as one line, exit 2."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

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


def test_a_users_reward_gets_the_prompt_completions_ids_state_and_fields_by_keyword() -> None:
    seen: dict[str, Any] = {}

    def spy(**given: Any) -> list[float]:
        seen.update(given)
        return [0.5] * len(given["completions"])

    state = rw.RewardState(global_step=3, max_steps=10, epoch=1)
    out = rw.score_group(
        [("mine", rw.resolve("tests.text.test_rewards:doubled", OPTIONS)), ("spy", spy)],
        "Reverse abc",
        ["ab", "abcd"],
        {"answer": "cba", "level": 2},
        index=7,
        completion_ids=[(97, 98, 0), [97, 98, 99, 100]],
        state=state,
    )
    assert out.tolist() == [[4.0, 0.5], [8.0, 0.5]]
    assert seen == {
        "prompts": ["Reverse abc"] * 2,
        "completions": ["ab", "abcd"],
        "completion_ids": [[97, 98, 0], [97, 98, 99, 100]],
        "trainer_state": state,
        "answer": ["cba"] * 2,
        "level": [2, 2],
    }


def trl_style(completions: list[list[dict[str, str]]], answer: list[str], **kwargs: Any) -> list[float]:
    """A reward as TRL's documentation writes one for conversational prompts: keywords, message lists."""
    return [float(c[0]["content"] == a) for c, a in zip(completions, answer, strict=True)]


def test_a_conversational_prompts_completions_are_assistant_messages_as_in_trl() -> None:
    prompt = [{"role": "system", "content": "Answer with a book."}, {"role": "user", "content": "Which?"}]
    rewards = [(n, rw.resolve(n, OPTIONS)) for n in ("tests.text.test_rewards:trl_style", "exact_match")]
    got = rw.score_group(
        rewards, prompt, ["Genesis", "Psalms"], {"answer": "Psalms"}, 0, completion_ids=[[1], [2]]
    )
    assert got.tolist() == [[0.0, 0.0], [1.0, 1.0]]  # the built-ins read a message's content too
    for name in ("format", "length"):  # the same values for a text and its message
        fn = rw.resolve(name, OPTIONS)
        texts = ["<answer>x</answer>", "abcdefgh"]
        assert fn(
            prompts=[prompt] * 2, completions=[[{"role": "assistant", "content": t}] for t in texts]
        ) == fn(prompts=["p"] * 2, completions=texts)


def test_trls_own_reward_functions_run_unchanged() -> None:
    trl_rewards = pytest.importorskip("trl.rewards")
    prompt = [{"role": "user", "content": "Think, then answer."}]
    texts = ["<think>\nhm\n</think>\n42", "42", "<think>no end"]
    ids = [[5, 6, 5, 6, 5, 6], [1, 2, 3], [7, 7, 7, 7]]
    repetition = trl_rewards.get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    got = rw.score_group(
        [("think", trl_rewards.think_format_reward), ("repetition", repetition)],
        prompt,
        texts,
        {},
        0,
        completion_ids=ids,
    )
    messages = [[{"role": "assistant", "content": t}] for t in texts]
    assert got[:, 0].tolist() == trl_rewards.think_format_reward(messages) == [1.0, 0.0, 0.0]
    assert got[:, 1].tolist() == pytest.approx(repetition(ids))
    assert got[0, 1] < 0 and got[1, 1] == 0  # the ids TRL's penalty reads are the sampled ones


async def awaited(completions: list[str], **kwargs: Any) -> list[float]:
    """An async reward, as TRL accepts (one that would wait on a judge or a sandbox)."""
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def test_an_async_reward_is_awaited() -> None:
    spec = "tests.text.test_rewards:awaited"
    got = rw.score_group(
        [(spec, rw.resolve(spec, OPTIONS))], "p", ["ab", "abc"], {}, 0, completion_ids=[[1], [2]]
    )
    assert got[:, 0].tolist() == [2.0, 3.0]


def only_odd(prompts: list[Any], completions: list[str], **fields: Any) -> list[float | None]:
    """A multi-task reward: it scores the odd-length completions alone (None: it does not apply)."""
    return [float(len(c)) if len(c) % 2 else None for c in completions]


def test_a_reward_returning_none_does_not_apply_and_the_total_sums_those_that_do() -> None:
    rewards = [(n, rw.resolve(n, OPTIONS)) for n in ("tests.text.test_rewards:only_odd", "exact_match")]
    scores = rw.score_group(rewards, "p", ["abc", "ab"], {"answer": "abc"}, 0, completion_ids=[[1], [2]])
    assert math.isnan(scores[1, 0]) and scores[0].tolist() == [3.0, 1.0] and scores[1, 1] == 0.0
    total = rw.weighted_total(scores, torch.tensor([0.5, 2.0], dtype=torch.float64))
    assert total.tolist() == [3.5, 0.0]
    # a completion no reward applies to has no total (NaN), not 0
    none_apply = torch.tensor([[math.nan, math.nan], [1.0, math.nan]], dtype=torch.float64)
    total = rw.weighted_total(none_apply, torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert math.isnan(total[0]) and total[1] == 1.0


@pytest.mark.parametrize("name", ["raising", "short", "nan"])
def test_a_bad_reward_is_a_data_error_naming_it_and_the_prompt(name: str) -> None:
    spec = f"tests.text.test_rewards:{name}"
    with pytest.raises(DataError) as e:
        rw.score_group(
            [(spec, rw.resolve(spec, OPTIONS))], "p", ["a", "b"], {}, 11, completion_ids=[[1], [2]]
        )
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
    reward = [("exact_match", rw.resolve("exact_match", OPTIONS))]
    with pytest.raises(DataError) as e:
        rw.score_group(reward, "p", ["a"], {"other": 1}, 0, completion_ids=[[1]])
    assert e.value.key == "task.answer_field" and e.value.value == "answer"
    assert e.value.valid == ("other",)  # the row's fields, not the keywords every reward is given


def test_the_toy_tasks_letters_in_place_reward() -> None:
    from text.prompts import letters_in_place

    got = letters_in_place([None] * 4, ["cba", " cbx ", "abc", "cbaa"], answer=["cba"] * 4)
    assert got == [1.0, 2 / 3, 1 / 3, 3 / 4]  # the longer of the two counts, so extra letters cost
