"""recipes.cli.options and recipes.cli.command: the one `key=value` parser and the one command wrapper of the
after-training commands (typed values, a repeated, unknown or out-of-range key as an ArgumentError naming it,
exit codes as core.errors declares them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import pytest

from core.bounds import Bounds
from core.errors import CheckpointWriteError, ConfigError, DataError, TrainingError, WorkerDied
from recipes import detect, export, generate, predict, transcribe
from recipes import eval as evaluate
from recipes.cli.command import command
from recipes.cli.options import ArgumentError, fields_of, parse_args, parse_options


@dataclass
class Options:
    """A command's keys, one of each type the parser converts to."""

    name: str = ""
    count: Annotated[int, Bounds(ge=1)] = 2
    rate: Annotated[float, Bounds(gt=0, le=1)] = 0.5
    strict: bool = False
    where: Path = Path(".")
    limit: int | None = None


USAGE = "usage: test name=TEXT [count=N ...]"


def parse(*argv: str) -> Options:
    return parse_options(list(argv), Options, usage=USAGE)


def error_of(*argv: str) -> ArgumentError:
    with pytest.raises(ArgumentError) as e:
        parse(*argv)
    return e.value


def test_values_are_converted_to_the_key_s_type() -> None:
    got = parse("name=1:1 yes", "count=3", "rate=0.25", "strict=yes", "where=~/runs", "limit=7")
    assert got == Options("1:1 yes", 3, 0.25, True, Path("~/runs").expanduser(), 7)
    assert parse("limit=null").limit is None and parse().count == 2


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("true", True),
        ("True", True),
        ("yes", True),
        ("1", True),
        ("false", False),
        ("no", False),
        ("0", False),
    ],
)
def test_bool_values(text: str, value: bool) -> None:
    assert parse(f"strict={text}").strict is value


@pytest.mark.parametrize(
    ("arg", "key", "value"),
    [("strict=maybe", "strict", "maybe"), ("count=two", "count", "two"), ("rate=half", "rate", "half")],
)
def test_a_value_of_the_wrong_type_names_its_key_and_value(arg: str, key: str, value: str) -> None:
    e = error_of(arg)
    assert (e.key, e.value) == (key, value) and isinstance(e, ConfigError)
    assert str(e).startswith(f"{key}={value!r} ")
    if key == "strict":
        assert set(e.valid) == {"true", "false", "yes", "no", "1", "0"}


def test_a_key_given_twice_is_refused_even_with_the_same_value() -> None:
    for second in ("count=3", "count=4"):
        e = error_of("count=3", second)
        assert (e.key, e.value) == ("count", second.partition("=")[2])


@pytest.mark.parametrize(
    ("arg", "key", "value"),
    [("count=0", "count", "0"), ("rate=0", "rate", "0.0"), ("rate=1.5", "rate", "1.5")],
)
def test_an_out_of_range_value_names_its_key(arg: str, key: str, value: str) -> None:
    e = error_of(arg)
    assert (e.key, e.value) == (key, value) and str(e).startswith(f"{key}={value} ")


def test_an_integer_past_int64_is_out_of_range() -> None:
    e = error_of(f"count={2**63}")
    assert (e.key, e.value) == ("count", str(2**63))


def test_an_unknown_key_names_it_and_lists_the_valid_ones() -> None:
    e = error_of("cout=3")
    assert (e.key, e.value) == ("cout", "3") and e.valid == tuple(fields_of(Options))
    values, overrides = parse_args(
        ["data.root=x", "count=3"], fields_of(Options), usage=USAGE, sections=("data",)
    )
    assert (values["count"], overrides) == (3, ["data.root=x"])
    e = error_of("task.decoder=greedy")  # a section this command does not take
    assert e.key == "task.decoder"


def test_an_argument_without_equals_is_named() -> None:
    assert (error_of("count").key, error_of("count").value) == ("count", None)


@pytest.mark.parametrize("module", [evaluate, predict, generate, transcribe, export, detect])
@pytest.mark.parametrize(
    ("args", "key"),
    [(["bogus_key=1"], "bogus_key"), (["ckpt=a", "ckpt=b"], "ckpt"), (["device"], "device")],
)
def test_every_after_training_command_refuses_a_bad_key_in_one_line_exit_2(
    module: object, args: list[str], key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # predict reads the run's task before its keys: give it a run directory to find that in
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("task: {name: image_classification}\n")
    argv = [a.replace("ckpt=a", f"ckpt={run}") for a in args]
    if module is predict and not any(a.startswith("ckpt=") for a in argv):
        argv = [f"ckpt={run}", *argv]
    assert module.main(argv) == 2  # type: ignore[attr-defined]
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and err.startswith("error: ") and (f"'{key}'" in err or f"{key} is given" in err)
    )


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ConfigError("k=v is bad"), 2),
        (DataError("input=x: no such file"), 2),
        (CheckpointWriteError("could not write x"), 74),
        (WorkerDied("worker died"), 70),
        (TrainingError("loss is nan"), 3),
    ],
)
def test_the_wrapper_exits_with_the_error_type_s_code(
    error: Exception, code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    def body(argv: list[str]) -> int:
        raise error

    main = command(body, usage=USAGE, describe=lambda: "help")
    assert main(["k=v"]) == code
    assert capsys.readouterr().err == f"error: {error}\n"
    assert main([]) == 2 and capsys.readouterr().err == f"{USAGE}\n"
    assert main(["k=v", "--help"]) == 0 and capsys.readouterr().out == "help\n"


def test_detect_exits_2_for_a_config_error_and_for_a_data_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # both found before any run is loaded: the range of score=, then the input that is not there
    assert detect.main([f"ckpt={tmp_path}", f"input={tmp_path / 'none.png'}", "score=2"]) == 2
    assert capsys.readouterr().err.startswith("error: score=2.0 ")
    assert detect.main([f"ckpt={tmp_path}", f"input={tmp_path / 'none.png'}"]) == 2
    assert capsys.readouterr().err.startswith(f"error: input={tmp_path / 'none.png'}: ")
