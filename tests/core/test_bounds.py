"""core.bounds: declared ranges admit exactly their values; NaN, infinities and int64 overflow never pass."""

from __future__ import annotations

import math
from typing import Annotated

import pytest

from core.bounds import INT64_MAX, Bounds, LazyChoices, bounds_of, check_values
from core.errors import ConfigError
from tests.helpers import fault


@pytest.mark.parametrize(
    ("bounds", "good", "bad", "described"),
    [
        (Bounds(ge=1), [1, 2, INT64_MAX], [0, -1, math.nan], ">= 1"),
        (Bounds(gt=0, lt=1), [0.5, 1e-9], [0, 1, math.nan], "> 0 and < 1"),
        (Bounds(ge=1, also=(-1,)), [-1, 1, 5], [0, -2], "-1 or >= 1"),
        (Bounds(choices=("a", "b")), ["a", "b"], ["c", ""], "a, b"),
    ],
)
def test_bounds_admit_exactly_their_values(bounds: Bounds, good: list, bad: list, described: str) -> None:
    assert all(bounds.admits(v) for v in good) and not any(bounds.admits(v) for v in bad)
    assert bounds.describe() == described


def test_lazy_choices_are_listed_once_when_first_checked_and_act_as_the_tuple() -> None:
    calls = []

    def source() -> list[str]:
        calls.append(1)
        return ["a", "b"]

    b = Bounds(choices=LazyChoices(source))
    assert calls == []  # declaring the bounds lists nothing
    assert b.admits("a") and not b.admits("c") and b.describe() == "a, b"
    with pytest.raises(ConfigError) as e:
        b.check("model.arch", "c")
    assert fault(e.value) == ("model.arch", "c", ("a", "b"))
    assert calls == [1] and tuple(b.choices) == ("a", "b") and len(b.choices) == 2


def test_lists_check_length_and_each_item() -> None:
    b = Bounds(ge=0, lt=1, length=2)
    b.check("optim.betas", [0.9, 0.99])
    with pytest.raises(ConfigError) as e:
        b.check("optim.betas", [0.9])
    assert fault(e.value) == ("optim.betas", "[0.9]", ("2 values, each >= 0 and < 1",))
    with pytest.raises(ConfigError) as e:
        b.check("optim.betas", [1.5, 0.9])
    assert fault(e.value) == ("optim.betas", "[1.5,0.9]", ("2 values, each >= 0 and < 1",))
    with pytest.raises(ConfigError) as e:
        Bounds(choices=("skip", "abort"), also=(None,)).check("data.on_bad_sample", "maybe")
    assert fault(e.value) == ("data.on_bad_sample", "maybe", ("None", "skip", "abort"))


def test_bounds_are_read_from_annotations_of_functions_and_classes() -> None:
    def build(*, width: Annotated[int, Bounds(ge=1)] = 4, name: str = "x") -> None:
        """A builder."""

    class Model:
        def __init__(self, *, p: Annotated[float, Bounds(ge=0, lt=1)] = 0.1) -> None:
            """A model."""

    assert bounds_of(build) == {"width": Bounds(ge=1)}
    assert bounds_of(Model) == {"p": Bounds(ge=0, lt=1)}
    with pytest.raises(ConfigError) as e:
        check_values("model", {"width": 0, "name": "y"}, build)
    assert fault(e.value) == ("model.width", "0", (">= 1",))


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, [1, 2**64]])
def test_integers_past_int64_and_infinite_floats_are_refused(value: object) -> None:
    def build(*, n: int = 1) -> None:
        """Unbounded by declaration."""

    with pytest.raises(ConfigError) as e:
        check_values("model", {"n": value}, build)
    assert fault(e.value)[:2] == ("model.n", str(value).replace(" ", "")) and "+-" in fault(e.value)[2][0]
    with pytest.raises(ConfigError) as e:
        check_values("model", {"n": math.inf}, build)
    assert fault(e.value) == ("model.n", "inf", ("a finite number",))
