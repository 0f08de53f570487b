"""The text recipes end to end through the CLI (tiny shapes), and their Hydra configs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from core.errors import ConfigError
from core.registry import TASKS
from recipes.cli.config import register_configs
from tests.helpers import TINY_CLS, TINY_LM, compose_train, fault, read_metrics, run_here, write_table


@pytest.mark.parametrize(
    ("overrides", "tokenizer", "model", "data"),
    [
        (["+task=lm"], "bytes", "gpt", "kjv"),
        (["+task=lm", "tokenizer=bpe", "data=text_files"], "bpe", "gpt", "text_files"),
        (["+task=text_classification"], "bpe", "text_encoder", "kjv_groups"),
        (
            ["+task=text_classification", "tokenizer=torchtext", "data=text_table"],
            "torchtext",
            "text_encoder",
            "text_table",
        ),
    ],
)
def test_text_configs_compose(overrides: list[str], tokenizer: str, model: str, data: str) -> None:
    register_configs()
    cfg = compose_train(overrides)
    assert (cfg.task.tokenizer, cfg.model.name, cfg.data.name) == (tokenizer, model, data)


def test_lm_recipe_trains_checkpoints_and_generates(
    cli_here: Callable, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = cli_here(
        "+task=lm",
        "trainer=smoke",
        "trainer.max_steps=3",
        "trainer.batch_size=4",
        *TINY_LM,
        "hydra.run.dir=run",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"
    metrics = json.loads((run / "result.json").read_text())["metrics"]
    assert math.isfinite(metrics["val/loss"]) and metrics["val/loss"] < 7.0  # ln(258) = 5.55 at chance
    assert (run / "model.safetensors").is_file() and list((run / "checkpoints").glob("step_*/meta.json"))

    from recipes.generate import main

    outputs = []
    for _ in range(2):
        assert main([f"ckpt={run}", "prompt=In the beginning", "max_new_tokens=20", "seed=5"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("In the beginning")


def test_classification_recipe_on_a_jsonl_table(cli_here: Callable, tmp_path: Path) -> None:
    write_table(tmp_path / "train.jsonl", 40)
    write_table(tmp_path / "val.jsonl", 5)
    data = ["data=text_table", "data.train=train.jsonl", "data.val=val.jsonl", "task.bpe_vocab_size=300"]
    loop = ["trainer=smoke", "trainer.max_steps=30", "trainer.max_epochs=10", "trainer.batch_size=8"]
    r = cli_here(
        "+task=text_classification",
        *loop,
        "optim.lr=1e-2",
        *data,
        *TINY_CLS,
        "hydra.run.dir=run",
        env={"TORCHKILN_CACHE": str(tmp_path / "cache")},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "result.json").read_text())["metrics"]
    assert metrics["val/accuracy"] == 1.0  # disjoint vocabularies: 30 steps separate them
    # the run keeps its label names and vocabulary: predict needs the run directory, not the tables
    run, env = tmp_path / "run", {"TORCHKILN_CACHE": str(tmp_path / "cache")}
    assert json.loads((run / "classes.json").read_text()) == {"classes": ["law", "song"]}
    assert (run / "tokenizer.json").is_file()
    (tmp_path / "texts.txt").write_text("sing and praise\n")
    predict = ["recipes.predict", f"ckpt={run}", f"input={tmp_path / 'texts.txt'}"]
    before = run_here(*predict, f"out={tmp_path / 'a.csv'}", env=env)
    (tmp_path / "train.jsonl").rename(tmp_path / "train.moved")
    after = run_here(*predict, f"out={tmp_path / 'b.csv'}", env=env)
    assert before.returncode == after.returncode == 0, after.stderr
    assert (tmp_path / "a.csv").read_text() == (tmp_path / "b.csv").read_text()
    assert (tmp_path / "b.csv").read_text().splitlines()[1].split(",")[1] == "song"
    # eval on a table whose labels the data numbers otherwise ("song" alone: its index 0) reads them by name
    songs = [x for x in (tmp_path / "val.jsonl").read_text().splitlines() if '"song"' in x]
    (tmp_path / "songs.jsonl").write_text("\n".join(songs) + "\n")
    table = [
        "data=text_table",
        f"data.train={tmp_path / 'songs.jsonl'}",
        f"data.val={tmp_path / 'songs.jsonl'}",
    ]
    out = tmp_path / "eval.json"
    r = run_here("recipes.eval", f"ckpt={run}", *table, f"out={out}", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["metrics"]["val/accuracy"] == 1.0  # 0.0 read as the data's indices
    # a label the run never learned: one line naming it, exit 2
    (tmp_path / "psalm.jsonl").write_text(json.dumps({"text": "harp", "label": "psalm"}) + "\n")
    other = [
        "data=text_table",
        f"data.train={tmp_path / 'psalm.jsonl'}",
        f"data.val={tmp_path / 'psalm.jsonl'}",
    ]
    r = run_here("recipes.eval", f"ckpt={run}", *other, env=env)
    assert r.returncode == 2 and "psalm" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_torchtext_without_torchtext_stops_the_task_with_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torchtext", None)  # as on the current stack, where it cannot load
    (tmp_path / "a.txt").write_text("In the beginning\n" * 20)
    data = {"name": "text_files", "root": str(tmp_path)}
    with pytest.raises(ConfigError) as e:
        TASKS.build("lm", model={"name": "gpt"}, data=data, tokenizer="torchtext")
    assert fault(e.value) == ("tokenizer", "torchtext", ("bytes", "bpe"))


def _warnings(*results: subprocess.CompletedProcess, runs: tuple[Path, ...]) -> list[str]:
    """The warning lines the commands printed and the runs logged (train.log)."""
    texts = [r.stdout + r.stderr for r in results] + [(run / "train.log").read_text() for run in runs]
    return [line for text in texts for line in text.splitlines() if "warning:" in line]


@pytest.mark.slow  # five runs and two exports of a tiny model: 113 s on 2 heavily shared cores
def test_the_llm_pipeline_presets_run_as_documented_without_a_warning_about_their_defaults(
    tmp_path: Path,
) -> None:
    # docs/llm.md § The pipeline at a tiny width: experiment=llm_pretrain, export format=hf, then
    # experiment=llm_sft (whose model.weights defaults to that export); each preset's context as it ships
    loop = ["trainer=smoke", "trainer.batch_size=2", "logger=none", "precision=fp32", "compile.policy=off"]

    def train(preset: str, run: str, *extra: str) -> subprocess.CompletedProcess:
        r = run_here(
            "recipes.train", f"experiment={preset}", f"hydra.run.dir=runs/{run}", *loop, *extra, cwd=tmp_path
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    tiny = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.n_kv_head=1", "model.hidden=64"]
    pretrain = train("llm_pretrain", "base", *tiny, "task.val_chunks=4")
    export = run_here("recipes.export", "ckpt=runs/base", "format=hf", cwd=tmp_path)
    assert export.returncode == 0, export.stderr[-3000:]
    sft = train("llm_sft", "sft", "task.eval_questions=2")
    runs = tmp_path / "runs"
    folder = json.loads((runs / "base" / "export" / "hf" / "config.json").read_text())
    run = OmegaConf.load(runs / "sft" / ".hydra" / "config.yaml")
    assert run.model.weights == "runs/base/export/hf"
    assert run.task.context <= folder["max_position_embeddings"]
    assert math.isfinite(json.loads((runs / "sft" / "result.json").read_text())["metrics"]["val/loss"])
    # LoRA on the same folder, read as a user's: its own tokenizer.json, the adapters alone trained
    lora = train("llm_lora_sft", "lora", "model.weights=runs/base/export/hf", "task.eval_questions=2")
    # preference tuning of the sft run's export (experiment=llm_dpo's model.weights): at step 0 it is its
    # own reference, so the DPO loss is ln 2 (the preset's SFT term off, which would add the chosen NLL)
    sft_export = run_here("recipes.export", "ckpt=runs/sft", "format=hf", cwd=tmp_path)
    assert sft_export.returncode == 0, sft_export.stderr[-3000:]
    dpo = train("llm_dpo", "dpo", "task.eval_questions=2", "data.per_book=20", "task.sft_weight=0")
    first = next(r for r in read_metrics(runs / "dpo") if r["step"] == 0)
    assert first["val/loss"] == pytest.approx(math.log(2), abs=1e-5) and "val/exact_match" in first
    # GRPO on the same export, the same held-out questions: at step 0 its reward is the SFT run's last
    # greedy exact match (the weights it exported)
    grpo = train("llm_grpo", "grpo", "task.eval_questions=2", "task.group_size=2")
    first = next(r for r in read_metrics(runs / "grpo") if r["step"] == 0)
    sft_result = json.loads((runs / "sft" / "result.json").read_text())["metrics"]
    assert first["val/reward"] == sft_result["val/exact_match"]
    said = _warnings(
        pretrain,
        export,
        sft,
        lora,
        sft_export,
        dpo,
        grpo,
        runs=(runs / "base", runs / "sft", runs / "lora", runs / "dpo", runs / "grpo"),
    )
    assert not [w for w in said if "task.context" in w], said
    # a context the user asks for past the folder's positions is still warned, naming the key
    longer = f"task.context={2 * folder['max_position_embeddings']}"
    asked = train("llm_sft", "long", "trainer.max_steps=1", "task.eval_questions=1", longer)
    assert [w for w in _warnings(asked, runs=(runs / "long",)) if "task.context" in w]
