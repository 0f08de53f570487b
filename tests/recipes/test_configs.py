"""Every shipped config composes, and bad command lines fail with one line and exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recipes.config import CONF_DIR
from recipes.train import check_overrides, main

TASKS = sorted(p.stem for p in (CONF_DIR / "task").glob("*.yaml"))


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("train", overrides=overrides)


@pytest.mark.parametrize("task", TASKS)
def test_each_task_composes_and_names_registered_parts(task: str) -> None:
    from core.registry import DATASETS, MODELS

    cfg = _compose([f"+task={task}"])
    assert cfg.task.name == task
    assert cfg.model.name in MODELS and cfg.data.name in DATASETS
    OmegaConf.resolve(cfg)


def _task_for(group: str, option: str) -> str:
    """The first task whose default part in `group` shares the domain of `option` (compose checks it)."""
    for task in TASKS:
        if check_overrides([f"+task={task}", f"{group}={option}"]) is None:
            return task
    raise AssertionError(f"{group}={option} composes with no task")


@pytest.mark.parametrize(
    ("group", "option"),
    [
        (g, p.stem)
        for g in ("model", "data", "optim", "trainer", "logger")
        for p in sorted((CONF_DIR / g).glob("*.yaml"))
    ],
)
def test_every_group_option_composes(group: str, option: str) -> None:
    cfg = _compose([f"+task={_task_for(group, option)}", f"{group}={option}"])
    assert cfg[group] is not None


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["+task=image_classification", "trainer.foo=1"],
            "unknown config key 'trainer.foo'; valid keys: batch_size",
        ),
        (
            ["+task=image_classification", "model.nope=3"],
            "unknown config key 'model.nope'; valid keys: dropout, name",
        ),
        (["+task=image_classification", "trainer.max_epochs=abc"], "trainer.max_epochs: Value 'abc'"),
        (["+task=nope"], "unknown task 'nope'; available: "),
        (
            ["+task=image_classification", "model=nope"],
            "unknown model 'nope'; available: conformer_ctc_m, conformer_ctc_s, conformer_ctc_xs, gpt, "
            "resnet18, small_cnn, text_encoder, vit",
        ),
    ],
)
def test_bad_override_is_one_line_exit_2(capsys, args: list[str], expected: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {expected}"), err
    assert len(err.strip().splitlines()) == 1


def test_cli_exit_code_and_no_traceback(cli) -> None:
    r = cli("+task=image_classification", "trainer.max_epochs=abc")
    assert r.returncode == 2 and r.stdout == ""
    assert (
        r.stderr == "error: trainer.max_epochs: Value 'abc' of type 'str' could not be converted to Integer\n"
    )


def test_bad_value_found_while_building_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["+task=image_classification", "data=imagefolder", "data.root=/nonexistent"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: data.root=/nonexistent: missing folder /nonexistent/train (expected DIR/train/<class>/*)"
    )


def test_no_task_lists_tasks(capsys) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "usage: python -m recipes.train +task=NAME" in err
    assert f"available tasks: {', '.join(TASKS)}" in err


def test_sweep_values_are_validated_before_launch(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["-m", "+task=image_classification", "optim.lr=1e-3,3e-3", "trainer.max_epochs=2,x"]) == 2
    assert capsys.readouterr().err.startswith("error: trainer.max_epochs: Value 'x'")
    assert not (tmp_path / "multirun").exists()  # nothing ran


@pytest.mark.parametrize("value", ["data.on_bad_sample=maybe", "data.max_bad_fraction=2"])
def test_a_bad_data_policy_stops_before_training_in_one_line(tmp_path: Path, cli, value: str) -> None:
    r = cli("+task=image_classification", value, f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {value.replace('2', '2.0')}")
