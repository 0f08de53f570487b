"""Every class of bad command line exits 2 with one line naming the key, before any work
(recipes.cli.validate).

The cases are generated from what the code declares (each field's `Bounds`, each int field, each registered
model/data/task option), so a new field or option is covered the day it lands.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import typing
from pathlib import Path
from typing import Any

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from core.bounds import Bounds, bounds_of
from core.compile import CompileConfig
from core.errors import TorchkilnError
from core.loop.trainer import TrainerConfig
from core.optim import OptimConfig
from core.registry import DATASETS, MODELS, TASKS
from recipes.cli.config import CONF_DIR, TrainConfig
from recipes.cli.overrides import check_overrides
from recipes.cli.validate import validate
from recipes.train import main
from tests.helpers import compose_train

SECTIONS: dict[str, type] = {
    "": TrainConfig,
    "trainer": TrainerConfig,
    "optim": OptimConfig,
    "compile": CompileConfig,
}


def _shipped(kind: str, reg: Any) -> list[str]:
    """Registered options with a config file (tests may register more, e.g. tests/core/killer_data.py)."""
    return [n for n in reg.names() if (CONF_DIR / kind / f"{n}.yaml").is_file()]


def _task_using(kind: str, option: str) -> str:
    """The first task that can use this model or data option."""
    for name in TASKS.names():
        cls = TASKS.get(name)
        fits = cls._model_fits if kind == "model" else cls._data_fits
        if fits((MODELS if kind == "model" else DATASETS).get(option)):
            return name
    raise AssertionError(f"no task uses {kind}={option}")


def _bad_values(b: Bounds, default: Any) -> list[Any]:
    """Values just outside what `b` admits (one per side it bounds)."""
    if isinstance(default, tuple):  # a builder's tuple default is a list in the config
        default = list(default)
    out: list[Any] = []
    if b.choices:
        numeric = all(isinstance(c, int) for c in b.choices)
        out = [max(b.choices) + 1 if numeric else "not_a_choice"]
    whole = isinstance(default, int) or (
        isinstance(default, list) and default and isinstance(default[0], int)
    )
    step = 1 if whole else 0.5
    out += [b.ge - step] if b.ge is not None else []
    out += [b.gt] if b.gt is not None else []
    out += [b.le + step] if b.le is not None else []
    out += [b.lt] if b.lt is not None else []
    out = [v for v in out if v not in b.also]
    if isinstance(default, list) and b.length is None:
        return [[v] for v in out]  # a list of choices: one bad item
    if b.length is not None:
        good = list(default)
        out = [[v] * b.length for v in out] + [good[:-1], [*good, good[-1]]]
    return out


def _override(key: str, value: Any) -> str:
    if isinstance(value, list):
        return f"{key}=[{','.join(str(v) for v in value)}]"
    return f"{key}={value}"


def _range_cases() -> list[tuple[list[str], str]]:
    cases = []
    for section, cls in SECTIONS.items():
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for field, b in bounds_of(cls).items():
            key = f"{section}.{field}" if section else field
            default = defaults[field]
            if default is dataclasses.MISSING:
                default = next(f.default_factory() for f in dataclasses.fields(cls) if f.name == field)
            for bad in _bad_values(b, default):
                cases.append((["+task=image_classification", _override(key, bad)], key))
    for kind, reg in (("model", MODELS), ("data", DATASETS)):
        for option in _shipped(kind, reg):
            task = _task_using(kind, option)
            builder = reg.get(option)
            defaults = _params(builder)
            for field, b in bounds_of(builder).items():
                if field not in defaults:
                    continue  # supplied by the task, not the config
                for bad in _bad_values(b, defaults[field]):
                    cases.append(
                        ([f"+task={task}", f"{kind}={option}", _override(f"{kind}.{field}", bad)], kind)
                    )
    for task in TASKS.names():
        params = _params(TASKS.get(task))
        for field, b in bounds_of(TASKS.get(task)).items():
            for bad in _bad_values(b, params[field]):
                cases.append(([f"+task={task}", _override(f"task.{field}", bad)], f"task.{field}"))
    return cases


def _params(builder: Any) -> dict[str, Any]:
    """A builder's defaulted keywords as a config spells them (a dataclass default's fields flat)."""
    out = {}
    for n, p in inspect.signature(builder).parameters.items():
        if dataclasses.is_dataclass(p.default):
            out.update(dataclasses.asdict(p.default))
        elif p.default is not p.empty:
            out[n] = p.default
    return out


RANGE_CASES = _range_cases()


@functools.cache
def _composed(base: tuple[str, ...]) -> DictConfig:
    """The config (with `hydra`) that `base` composes to, composed once per test process."""
    return compose_train(list(base), hydra=True)


RANGE_IDS = [" ".join(a[1:]) for a, _ in RANGE_CASES]
#: one case per composition base (48 of the 600): each through the whole command-line check as well
CLI_RANGE_CASES = list({tuple(a[:-1]): (a, k) for a, k in reversed(RANGE_CASES)}.values())[::-1]


@pytest.mark.parametrize(("args", "key"), RANGE_CASES, ids=RANGE_IDS)
def test_every_declared_range_is_enforced_before_work(args: list[str], key: str) -> None:
    # The validator on the config the other overrides compose to, the bad value set as Hydra's parser reads
    # it: one composition per task/option pair (~0.2 s each) instead of one per case; the whole
    # command-line check, composing each, on one case of each pair below.
    override = OverridesParser.create().parse_override(args[-1])
    name = override.get_key_element()
    cfg = copy.deepcopy(_composed(tuple(args[:-1])))
    OmegaConf.update(cfg, name, override.value(), merge=False)
    with pytest.raises(TorchkilnError) as e:
        validate(cfg)
    err = str(e.value)
    assert err.startswith(f"{name}="), (args, err)
    assert "valid:" in err and "\n" not in err


@pytest.mark.parametrize(("args", "key"), CLI_RANGE_CASES, ids=[" ".join(a[1:]) for a, _ in CLI_RANGE_CASES])
def test_a_range_of_each_task_and_option_is_refused_by_the_command_line_check(
    args: list[str], key: str
) -> None:
    err = check_overrides(args)
    assert err is not None and err.startswith(f"{args[-1].split('=')[0]}="), (args, err)
    assert "valid:" in err and "\n" not in err


def test_range_cases_cover_every_section() -> None:
    keys = {a[-1].split("=")[0].split(".")[0] for a, _ in RANGE_CASES}
    assert {"trainer", "optim", "compile", "model", "data", "task", "seed"} <= keys, keys


INT_FIELDS = [
    f"{section}.{f.name}" if section else f.name
    for section, cls in SECTIONS.items()
    for f, hint in ((f, typing.get_type_hints(cls)[f.name]) for f in dataclasses.fields(cls))
    if hint is int
]


@pytest.mark.parametrize("key", INT_FIELDS)
def test_integers_past_int64_are_refused(key: str) -> None:
    err = check_overrides(["+task=image_classification", f"{key}={2**63}"])
    assert err is not None and err.startswith(f"{key}={2**63} is too large"), err


@pytest.mark.parametrize("section", ["trainer", "optim", "compile", "model", "data", "task", ""])
def test_keys_added_with_plus_are_unknown_keys(section: str) -> None:
    key = f"{section}.bogus" if section else "bogus"
    assert check_overrides(["+task=image_classification", f"+{key}=1"]).startswith(
        f"unknown config key '{key}'"
    )


@pytest.mark.parametrize("part", ["model", "data"])
def test_a_deleted_section_is_named(part: str) -> None:
    assert check_overrides(["+task=image_classification", f"~{part}"]) == (
        f"the {part} section is missing; give it with {part}=NAME"
    )


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("optim.lr=${nonexistent}", "optim.lr"),
        ("trainer.batch_size=${oc.env:TORCHKILN_NOT_SET_ANYWHERE}", "trainer"),
    ],
)
def test_unresolvable_interpolations_are_named(override: str, key: str) -> None:
    err = check_overrides(["+task=image_classification", override])
    assert err is not None and err.startswith(key), err


PAIRS = [
    (task, kind, option)
    for task in TASKS.names()
    for kind, reg in (("model", MODELS), ("data", DATASETS))
    for option in _shipped(kind, reg)
]


def _fits(task: str, kind: str, option: str) -> bool:
    """Whether the task's declared pairing takes this shipped model or data option."""
    cls = TASKS.get(task)
    return (cls._model_fits if kind == "model" else cls._data_fits)(
        (MODELS if kind == "model" else DATASETS).get(option)
    )


@pytest.mark.parametrize(("task", "kind", "option"), PAIRS)
def test_task_model_data_pairs(task: str, kind: str, option: str) -> None:
    err = check_overrides([f"+task={task}", f"{kind}={option}"])
    if _fits(task, kind, option):
        assert err is None or not err.startswith(f"{kind}={option} cannot be used"), err
    else:
        assert err is not None and err.startswith(f"{kind}={option} cannot be used by +task={task}; "), err


def test_every_task_refuses_some_other_domains_parts() -> None:
    # the command line refuses exactly the pairs that do not fit: test_task_model_data_pairs, pair by pair
    refused = {t for t, k, o in PAIRS if not _fits(t, k, o)}
    assert refused == set(TASKS.names())


def test_a_key_given_twice_is_refused() -> None:
    err = check_overrides(["+task=image_classification", "trainer.batch_size=8", "trainer.batch_size=16"])
    assert (
        err == "trainer.batch_size is given twice (trainer.batch_size=8, trainer.batch_size=16); give it once"
    )


def test_run_dirs_that_cannot_be_used(tmp_path: Path) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for bad in ("''", str(a_file), str(a_file / "sub"), "/proc/torchkiln-run"):
        err = check_overrides(["+task=image_classification", f"hydra.run.dir={bad}"])
        assert err is not None and err.startswith("hydra.run.dir"), (bad, err)
    err = check_overrides(["+task=image_classification", f"hydra.sweep.dir={a_file}"], multirun=True)
    assert err is not None and err.startswith(f"hydra.sweep.dir={a_file}"), err


def test_a_usable_run_dir_is_checked_without_a_trace(tmp_path: Path) -> None:
    assert check_overrides(["+task=image_classification", f"hydra.run.dir={tmp_path}/a/b/c"]) is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "sweep", ["device=cpu,tpu", "trainer.batch_size=32,0", "optim.betas=[0.9,0.9],[0.9]"]
)
def test_every_swept_value_is_checked_before_the_first_job(
    tmp_path: Path, monkeypatch, capsys, sweep: str
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["-m", "+task=image_classification", "trainer=smoke", sweep]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {sweep.split('=')[0]}=") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "multirun").exists()


def test_a_model_too_large_for_memory_is_one_line_before_data(tmp_path: Path, cli_here) -> None:
    r = cli_here(
        "+task=lm", "task.context=1000000000", "trainer=smoke", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path
    )
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()
    assert len(last) == 1 and last[0].startswith("error: the model does not fit in cpu memory"), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "checkpoints").exists()


def test_the_shipped_configs_pass_validation() -> None:
    shipped = sorted(p.stem for p in (CONF_DIR / "task").glob("*.yaml"))
    assert set(shipped) >= {"asr", "detection", "image_classification", "lm", "text_classification"}
    for task in shipped:
        assert check_overrides([f"+task={task}"]) is None
