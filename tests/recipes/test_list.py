"""`python -m recipes.list` and `python -m recipes.train --help` (recipes/list.py, recipes/cli/catalog.py):
what a command line can name, and every key of every part documented. One listing, `train --help` and
Hydra's help run as a user runs them (a subprocess); the rest call the same `main(argv)` in this process,
which prints the same lines and returns the same exit code without paying a process start each."""

from __future__ import annotations

import importlib
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from core.registry import MODELS, TASKS
from recipes.cli.catalog import TASK_INPUT, config_keys
from recipes.cli.config import CONF_DIR, schema_from_builder
from recipes.list import options_table

TASK_NAMES = sorted(p.stem for p in (CONF_DIR / "task").glob("*.yaml"))


@pytest.fixture
def command(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., subprocess.CompletedProcess]:
    """`python -m MODULE ARGS...` in this process, in tmp_path (as the `cli` fixture runs it): its
    `main(argv)`'s exit code and what it printed."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str, module: str = "recipes.train") -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = importlib.import_module(module).main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess([module, *args], code, out.out, out.err)

    return run


def _rows(stdout: str) -> list[list[str]]:
    """The columns of each printed line (columns are two or more spaces apart)."""
    return [re.split(r"\s{2,}", line.strip(), maxsplit=2) for line in stdout.splitlines() if line.strip()]


def _composed(task: str) -> dict[str, Any]:
    """Dotted key -> value of the config `+task=task` composes (interpolations unresolved)."""
    return _composed_with([f"+task={task}"])


def _composed_with(overrides: list[str]) -> dict[str, Any]:
    """Dotted key -> value of the config `overrides` compose (interpolations unresolved)."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = OmegaConf.to_container(compose("train", overrides=overrides), resolve=False)
    finally:
        GlobalHydra.instance().clear()
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            flat[prefix[:-1]] = node

    walk(cfg, "")
    return flat


def test_tasks_lists_every_task_with_a_doc(cli_here) -> None:
    r = cli_here("tasks", module="recipes.list")
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    assert [row[0] for row in rows] == TASK_NAMES
    assert all(len(row) == 2 and row[1] for row in rows), r.stdout


@pytest.mark.parametrize(
    ("section", "task", "present", "absent"),
    [
        ("models", "image_classification", {"small_cnn", "resnet18", "vit"}, {"gpt", "conformer_ctc_xs"}),
        ("models", "asr", {"conformer_ctc_xs", "conformer_ctc_s", "conformer_ctc_m"}, {"small_cnn", "gpt"}),
        ("data", "lm", {"kjv", "text_files"}, {"digits", "espeak_words", "kjv_groups"}),
    ],
)
def test_parts_for_a_task_are_those_it_accepts(
    command, section: str, task: str, present: set[str], absent: set[str]
) -> None:
    r = command(section, "--task", task, module="recipes.list")
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    names = {row[0] for row in rows}
    assert names == set(TASKS.get(task).accepted(section.rstrip("s")))
    assert present <= names and not absent & names
    assert all(len(row) == 2 and row[1] for row in rows), r.stdout


def test_parts_without_a_task_name_the_tasks_that_use_them(command) -> None:
    r = command("models", module="recipes.list")
    assert r.returncode == 0, r.stderr
    users = {row[0]: row[1].split(",") for row in _rows(r.stdout)}
    assert users["gpt"] == ["distill", "dpo", "grpo", "lm", "sft"]
    assert users["small_cnn"] == ["image_classification"]


@pytest.mark.parametrize("task", TASK_NAMES)
def test_keys_have_a_doc_and_the_composed_default(command, task: str) -> None:
    r = command("keys", "--task", task, module="recipes.list")
    assert r.returncode == 0, r.stderr
    expected = _composed(task)
    rows = _rows(r.stdout)
    assert [row[0] for row in rows] == list(expected)
    parser = OverridesParser.create()
    for row in rows:
        assert len(row) == 3 and row[2], f"{row[0]} has no doc"
        # the printed default, given back on a command line, is the composed value
        assert parser.parse_override(f"{row[0]}={row[1]}").value() == expected[row[0]], row


def _each_part_once() -> list[list[str]]:
    """Each task with its defaults, then each shipped model and data option with the first task that
    accepts it: a section's keys are its builder's schema whatever the task (a config file sets no key the
    schema lacks), so every pair would check the same docs again."""
    out = [[f"+task={task}"] for task in TASK_NAMES]
    for kind in ("model", "data"):
        # the shipped options (a test may register others, e.g. tests/core/killer_data.py, with no file)
        for p in sorted((CONF_DIR / kind).glob("*.yaml")):
            task = next(t for t in TASK_NAMES if p.stem in TASKS.get(t).accepted(kind))
            out.append([f"+task={task}", f"{kind}={p.stem}"])
    return out


@pytest.mark.parametrize("overrides", _each_part_once(), ids=" ".join)
def test_every_part_a_task_accepts_documents_its_keys(overrides: list[str]) -> None:
    missing = [k.name for k in config_keys(overrides) if not k.doc]
    assert not missing, f"{' '.join(overrides)}: no doc for {missing}"


def _option_columns(stdout: str) -> dict[str, dict[str, Any]]:
    """`recipes.list models NAME ...`'s table as option -> key -> value, each value read back as a command
    line reads it (the task's inputs kept as printed)."""
    lines = [re.split(r"\s{2,}", line.strip()) for line in stdout.splitlines() if line.strip()]
    names = lines[0][1:-1]
    parser = OverridesParser.create()
    out: dict[str, dict[str, Any]] = {name: {} for name in names}
    for key, *cells in (line[: len(names) + 1] for line in lines[1:]):
        for name, cell in zip(names, cells, strict=True):
            if cell != "-":
                out[name][key] = cell if cell == TASK_INPUT else parser.parse_override(f"k={cell}").value()
    return out


def test_a_model_presets_listed_sizes_are_its_builders(command) -> None:
    r = command("models", "llama_1b", module="recipes.list")
    assert r.returncode == 0, r.stderr
    listed = _option_columns(r.stdout)["llama_1b"]
    # the preset's schema (its builder's keyword defaults), as a run composes it
    schema = OmegaConf.structured(schema_from_builder("model", "llama_1b", MODELS.get("llama_1b")))
    assert {k: v for k, v in listed.items() if v != TASK_INPUT} == {
        f"model.{k}": v for k, v in OmegaConf.to_container(schema).items()
    }
    run = _composed_with(["+task=lm", "model=llama_1b"])
    assert all(run[k] == v for k, v in listed.items() if k != "model.name" and v != TASK_INPUT)
    # Llama 3.2 1B's published shape, and its task-given inputs named
    shape = {"n_layer": 16, "n_head": 32, "n_kv_head": 8, "d_model": 2048, "hidden": 8192, "rope_theta": 5e5}
    assert {k: listed[f"model.{k}"] for k in shape} == shape
    assert listed["model.vocab_size"] == listed["model.context"] == TASK_INPUT
    # the listed sizes given to the plain `llama` builder build Meta's 1,235,814,400 parameters
    sizes = {k.removeprefix("model."): v for k, v in listed.items() if v != TASK_INPUT and k != "model.name"}
    with torch.device("meta"):
        model = MODELS.build("llama", **sizes, vocab_size=128256, context=8192)
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400


@pytest.mark.parametrize(
    ("kind", "name"), [(g, p.stem) for g in ("model", "data") for p in sorted((CONF_DIR / g).glob("*.yaml"))]
)
def test_every_model_and_data_file_names_the_listing_of_its_keys(kind: str, name: str) -> None:
    section = "models" if kind == "model" else "data"
    assert (
        f"# Every key and value: python -m recipes.list {section} {name}\n"
        in (CONF_DIR / kind / f"{name}.yaml").read_text()
    )
    assert _option_columns(options_table(kind, [name]))[name][f"{kind}.name"] == name


def test_several_options_get_a_column_each(command) -> None:
    r = command("models", "gpt", "llama", "--task", "lm", module="recipes.list")
    assert r.returncode == 0, r.stderr
    listed = _option_columns(r.stdout)
    assert listed["gpt"]["model.name"] == "gpt" and listed["llama"]["model.name"] == "llama"
    assert "model.n_kv_head" in listed["llama"] and "model.n_kv_head" not in listed["gpt"]  # printed "-"
    # a config file's own settings over its schema's: whisper's pinned weights
    whisper = _option_columns(command("models", "whisper", module="recipes.list").stdout)["whisper"]
    assert whisper["model.weights"] == _composed("asr")["model.weights"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["sizes"], ["sizes", "models"]),
        (["models", "--task", "nope"], ["nope", "image_classification"]),
        (["keys", "--task", "nope"], ["nope", "lm"]),
        (["keys"], ["--task", "asr"]),
        (["models", "llama_2b"], ["llama_2b", "llama_1b"]),
        (["data", "kjv_groups", "--task", "lm"], ["kjv_groups", "text_files"]),
        (["tasks", "lm"], ["lm", "models"]),
    ],
)
def test_a_bad_argument_is_one_line_exit_2(command, args: list[str], named: list[str]) -> None:
    r = command(*args, module="recipes.list")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert all(n in r.stderr for n in named), r.stderr
    assert "Traceback" not in r.stderr


def test_train_help_lists_tasks_not_schema_groups(cli_here) -> None:
    r = cli_here("--help")
    assert r.returncode == 0, r.stderr
    assert "+task=" in r.stdout and all(t in r.stdout for t in TASK_NAMES)
    assert "schema/" not in r.stdout


def test_train_help_for_a_task_shows_its_keys(command) -> None:
    r = command("+task=lm", "--help")
    assert r.returncode == 0, r.stderr
    assert "+task=lm" in r.stdout.splitlines()[0]
    assert "trainer.max_steps" in r.stdout and "schema/" not in r.stdout
    listed = command("keys", "--task", "lm", module="recipes.list")
    assert listed.stdout.strip() in r.stdout  # one listing, two entry points


def test_train_help_follows_the_chosen_model(command) -> None:
    r = command("+task=image_classification", "model=vit", "--help")
    assert r.returncode == 0, r.stderr
    keys = {row[0] for row in _rows(r.stdout)}
    assert "model.patch_size" in keys and "model.width" not in keys


@pytest.mark.slow  # Hydra's help composes every config group: 13 s of one core (#38 point 5)
def test_hydra_help_stays_hydras(cli_here) -> None:
    r = cli_here("--hydra-help")
    assert r.returncode == 0, r.stderr
    assert "--cfg" in r.stdout


def test_a_model_the_task_cannot_use_fails_before_any_work(command, tmp_path: Path) -> None:
    r = command("+task=image_classification", "model=gpt")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "model=gpt" in r.stderr
    assert all(m in r.stderr for m in TASKS.get("image_classification").accepted("model"))
    assert "conformer_ctc_xs" not in r.stderr and "text_encoder" not in r.stderr
    assert not (tmp_path / "outputs").exists()  # no run directory: nothing was set up


def test_an_unknown_model_lists_only_what_the_task_can_use(command, tmp_path: Path) -> None:
    r = command("+task=image_classification", "model=resnet")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "resnet" in r.stderr and all(m in r.stderr for m in ("small_cnn", "resnet18", "vit"))
    assert "gpt" not in r.stderr and "conformer_ctc_xs" not in r.stderr
    assert not (tmp_path / "outputs").exists()
