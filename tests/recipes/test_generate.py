"""recipes.generate: argument parsing and the errors for a wrong run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import CheckpointError, ConfigError
from recipes.cli.runs import locate
from recipes.generate import main, parse_args
from tests.helpers import fault

#: the keys generate takes, in the order its unknown-key error lists them
KEYS = (
    "ckpt",
    "prompt",
    "device",
    "precision",
    "chat",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "stop",
    "seed",
    "overflow_keep",
)


def test_values_are_taken_as_written() -> None:
    cfg = parse_args(["ckpt=runs/a", "prompt=1:1 yes = no", "top_k=5", "temperature=0.5", "seed=3"])
    assert [cfg[k] for k in ("ckpt", "prompt", "top_k", "temperature", "seed")] == [
        "runs/a",
        "1:1 yes = no",
        5,
        0.5,
        3,
    ]


def test_sampling_keys_come_from_the_task_s_predict() -> None:
    values = parse_args(["ckpt=a", "top_p=0.9", r"stop=\n\n", "overflow_keep=64"])
    assert (values["top_p"], values["overflow_keep"], values["stop"]) == (0.9, 64, r"\n\n")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["ckpt=a", "topk=5"], ("topk", "5", KEYS)),
        (["ckpt=a", "top_k=five"], ("top_k", "five", ())),
        (["prompt=x"], ("ckpt", None, ())),  # required
        (["ckpt"], ("ckpt", None, ("KEY=VALUE",))),
        (["ckpt=a", "top_p=1.5"], ("top_p", "1.5", ("> 0 and <= 1",))),
        (["ckpt=a", "temperature=-1"], ("temperature", "-1.0", (">= 0",))),
    ],
)
def test_bad_arguments_are_config_errors(argv: list[str], expected: tuple) -> None:
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert fault(e.value) == expected


def test_locate_accepts_a_run_or_a_checkpoint_folder(tmp_path: Path) -> None:
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("{}")
    step = tmp_path / "checkpoints" / "step_00000003"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    assert locate(str(tmp_path)) == (tmp_path, None)
    assert locate(str(step)) == (tmp_path, step)
    with pytest.raises(CheckpointError) as e:
        locate(str(tmp_path / "checkpoints"))
    assert fault(e.value) == (
        "ckpt",
        str(tmp_path / "checkpoints"),
        (
            "a run directory with .hydra/config.yaml",
            "a checkpoints/step_* folder",
            "a Hugging Face model folder",
        ),
    )


def test_cli_prints_one_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([f"ckpt={tmp_path}", "prompt=x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ckpt=")


def test_a_foreign_run_config_is_read_without_resolving_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a run directory someone else wrote: its saved config reads this machine's environment if resolved
    monkeypatch.setenv("TORCHKILN_SECRET", "s3cr3t")
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(
        "task:\n  name: lm\nmodel:\n  name: gpt\ndata:\n  name: '${oc.env:TORCHKILN_SECRET}'\n"
    )
    (run / "model.safetensors").write_bytes(b"")
    assert main([f"ckpt={run}", "prompt=hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data.name holds the interpolation" in err and "s3cr3t" not in err
