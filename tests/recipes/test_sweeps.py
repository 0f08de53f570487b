"""Sweeps end to end through the CLI (recipes.cli.sweep, recipes.report): an Optuna search
(`hparams_search=`), a trial that fails while the search goes on, the basic sweeper with a failed job,
sweep_summary.csv's columns, and the report of each."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from core.errors import ConfigError
from recipes.cli.config import CONF_DIR
from recipes.cli.overrides import check_overrides
from recipes.report import main as report
from recipes.train import main as train
from tests.helpers import cli_env

pytest.importorskip("optuna")  # the `optuna` extra (hydra-optuna-sweeper)

TINY = ["+task=image_classification", "model.width=16", "trainer.max_steps=3", "trainer.progress=false"]
TINY += ["logger=none"]
SEARCHED = ["optim.lr", "optim.weight_decay", "optim.warmup_ratio", "model.dropout"]  # model.width: fixed
# with lr=1e30 the weights are infinite after one step, and the run stops at once (trainer.nonfinite=abort)
DIVERGES = ["trainer.nonfinite=abort"]


def _sweep(tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / "sweep"
    cmd = [sys.executable, "-m", "recipes.train", "-m", *TINY, *args, f"hydra.sweep.dir={out}"]
    r = subprocess.run(cmd, cwd=tmp, env=cli_env(), capture_output=True, text=True, timeout=300)
    return r, out


@pytest.fixture(scope="module")
def optuna_search(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """3 trials of conf/hparams_search/image_classification.yaml (3 steps each), its lr range replaced by two
    values, one of which diverges. The search's seed 0 draws 1e30 for trial 0 and 3e-3 for trials 1 and 2
    (Optuna is pinned, NumPy keeps RandomState's stream fixed); the tests assert the rule, not the order."""
    tmp = tmp_path_factory.mktemp("optuna")
    search = ["hparams_search=image_classification", "hydra.sweeper.n_trials=3"]
    return _sweep(tmp, *search, *DIVERGES, "optim.lr=choice(3e-3,1e30)")


def _summary(sweep: Path) -> list[dict[str, str]]:
    with (sweep / "sweep_summary.csv").open() as fh:
        return list(csv.DictReader(fh))


def _result(sweep: Path, job: str) -> dict:
    return json.loads((sweep / job / "result.json").read_text())


def _table(report_md: Path) -> tuple[list[str], list[list[str]]]:
    """report.md's table: its header and rows, cells stripped."""
    lines = [ln for ln in report_md.read_text().splitlines() if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    return cells[0], cells[2:]  # cells[1] is the |---| rule


def _pngs_open(sweep: Path) -> None:
    for name in ("report_curves.png", "report_params.png"):
        with Image.open(sweep / name) as im:
            assert im.format == "PNG" and im.width >= 300 and im.height >= 200


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_an_optuna_search_summarises_every_trial_with_its_swept_keys_as_columns(optuna_search) -> None:
    r, sweep = optuna_search
    assert r.returncode == 0, r.stderr[-3000:]  # a search that ran to its end exits 0, failed trials and all
    rows = _summary(sweep)
    assert [row["job"] for row in rows] == ["0", "1", "2"]
    assert list(rows[0])[:2] == ["job", "status"] and list(rows[0])[2:6] == SEARCHED
    assert "model.width" not in rows[0]  # the command line fixed it, so it left the search
    for row in rows:
        result = _result(sweep, row["job"])
        given = dict(o.split("=", 1) for o in result["overrides"])
        assert all(row[k] == given[k] for k in SEARCHED)
        assert 0 <= float(row["optim.weight_decay"]) <= 0.1 and 0 <= float(row["model.dropout"]) <= 0.4
        assert float(row["wall_s"]) == result["wall_s"] > 0
        if row["optim.lr"] == "1e+30":  # diverged: recorded failed with its error, and the search went on
            assert row["status"] == result["status"] == "failed" and "non-finite loss" in row["error"]
            assert not row["val/accuracy"]
        else:
            assert row["status"] == "ok" and result["monitor"] == {"key": "val/accuracy", "mode": "max"}
            assert float(row["best/val/accuracy"]) == result["metrics"]["best/val/accuracy"]
    assert {row["status"] for row in rows} == {"ok", "failed"}
    # what each trial returned to Optuna is its best val/accuracy: the study's best is the best of those
    study = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    done = [row for row in rows if row["status"] == "ok"]
    assert study["best_value"] == max(float(row["best/val/accuracy"]) for row in done)
    assert study["best_params"]["optim.lr"] == 0.003


@pytest.mark.slow  # an Optuna search of several trials (#38 point 5); the grid sweep's report stays default
def test_the_report_of_an_optuna_search_has_a_column_per_swept_key_and_a_row_per_trial(
    optuna_search,
) -> None:
    _, sweep = optuna_search
    assert report([str(sweep)]) == 0
    head, rows = _table(sweep / "report.md")
    assert head == ["job", *SEARCHED, "final val/accuracy", "best val/accuracy", "wall s", "status"]
    assert [row[0].split()[0] for row in rows] == ["0", "1", "2"]
    for row in rows:
        result = _result(sweep, row[0].split()[0])
        given = dict(o.split("=", 1) for o in result["overrides"])
        # the table shows swept values to 4 significant digits, metrics to 6, wall seconds to 0.1
        for key, cell in zip(SEARCHED, row[1:5], strict=True):
            assert float(cell) == pytest.approx(float(given[key]), rel=1e-3)
        assert float(row[7]) == pytest.approx(result["wall_s"], abs=0.051) and row[8] == result["status"]
        if result["status"] == "ok":
            metrics = result["metrics"]
            assert float(row[5]) == pytest.approx(metrics["val/accuracy"], rel=1e-5)
            assert float(row[6]) == pytest.approx(metrics["best/val/accuracy"], rel=1e-5)
        else:
            assert row[5:7] == ["", ""]
            assert f"- job {row[0]}: error: non-finite loss" in (sweep / "report.md").read_text()
    done = [row for row in rows if row[8] == "ok"]
    starred = [row[0].split()[0] for row in rows if "★" in row[0]]
    assert starred == [max(done, key=lambda row: float(row[6]))[0].split()[0]]
    _pngs_open(sweep)


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_a_basic_sweep_goes_on_past_a_failed_job_and_is_reported(tmp_path: Path) -> None:
    r, sweep = _sweep(tmp_path, *DIVERGES, "optim.lr=1e30,3e-3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "error: non-finite loss" in r.stderr and "(1 ok, 1 failed)" in r.stdout
    rows = _summary(sweep)
    assert [(row["job"], row["status"], row["optim.lr"]) for row in rows] == [
        ("0", "failed", "1e+30"),
        ("1", "ok", "0.003"),
    ]
    assert list(rows[0])[:4] == ["job", "status", "optim.lr", "wall_s"]
    cmd = [sys.executable, "-m", "recipes.report", str(sweep)]
    rep = subprocess.run(cmd, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    head, table = _table(sweep / "report.md")
    assert head[:2] == ["job", "optim.lr"] and [row[-1] for row in table] == ["failed", "ok"]
    best = _result(sweep, "1")["metrics"]["best/val/accuracy"]
    assert table[1][0] == "1 ★"
    assert float(table[1][head.index("best val/accuracy")]) == pytest.approx(best, rel=1e-5)
    _pngs_open(sweep)


def test_a_job_without_result_json_reads_as_failed(tmp_path: Path, capsys) -> None:
    # a job killed mid-run: its config and log, no result.json
    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "0" / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.1\n")
    (tmp_path / "0" / "train.log").write_text("[step 2/9] train/loss=2.2\nKilled\n")
    assert report([str(tmp_path)]) == 0
    head, table = _table(tmp_path / "report.md")
    assert table == [["0", "", "", "", "failed"]]
    text = (tmp_path / "report.md").read_text()
    assert "no result.json" in text and "train.log ends: Killed" in text


def _job(sweep: Path, name: str, lr: str, rows: list[dict], final: dict) -> None:
    """A finished job's directory as recipes.train leaves it: result.json (its final metrics) and
    metrics.jsonl (what it logged, step by step)."""
    job = sweep / name
    job.mkdir(parents=True)
    result = {"status": "ok", "overrides": [f"optim.lr={lr}"], "metrics": final, "wall_s": 1.0}
    result["monitor"] = {"key": "val/loss", "mode": "min"}
    (job / "result.json").write_text(json.dumps(result))
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_report_shows_each_jobs_last_benchmark_scores_centred_where_logged(tmp_path: Path) -> None:
    mc = {"eval/kjv_book_mc/acc": 0.5, "eval/kjv_book_mc/centered_acc": 1 / 3}
    # job 0 scored the benchmarks at both evaluations: the last one's values are shown
    first = {"step": 1, "val/loss": 3.0, "eval/kjv_book_mc/acc": 0.25, "eval/kjv_book_mc/centered_acc": 0.0}
    last = {"step": 2, "val/loss": 2.0, **mc, "eval/kjv_book_mc/sample_len": 8.0}  # a count: no column
    last["eval/mine/f1"] = 0.75  # a task without a centred score
    _job(tmp_path, "0", "0.1", [first, {"step": 2, "train/loss": 2.5}, last], {"val/loss": 2.0, **mc})
    # job 1's trainer.evals_every skipped its final evaluation: its result.json has no eval/*
    early = {"step": 1, "val/loss": 2.5, "eval/kjv_book_mc/acc": 1.0, "eval/kjv_book_mc/centered_acc": 1.0}
    _job(tmp_path, "1", "0.2", [early, {"step": 2, "val/loss": 1.5}], {"val/loss": 1.5})
    _job(tmp_path, "2", "0.3", [{"step": 2, "val/loss": 1.8}], {"val/loss": 1.8})  # no trainer.evals
    assert report([str(tmp_path)]) == 0
    head, table = _table(tmp_path / "report.md")
    benchmarks = ["eval/kjv_book_mc/centered_acc", "eval/mine/f1"]  # the raw acc gives way to the centred
    assert head == ["job", "optim.lr", "final val/loss", "best val/loss", *benchmarks, "wall s", "status"]
    cells = {row[0].split()[0]: row[4:6] for row in table}
    assert {job: [float(c) if c else None for c in row] for job, row in cells.items()} == {
        "0": [pytest.approx(1 / 3, rel=1e-3), 0.75],
        "1": [1.0, None],
        "2": [None, None],
    }


def test_a_sweep_without_benchmarks_has_no_benchmark_columns(tmp_path: Path) -> None:
    _job(tmp_path, "0", "0.1", [{"step": 1, "val/loss": 2.0}], {"val/loss": 2.0})
    _job(tmp_path, "1", "0.2", [{"step": 1, "val/loss": 1.0}], {"val/loss": 1.0})
    assert report([str(tmp_path)]) == 0
    head, _ = _table(tmp_path / "report.md")
    assert head == ["job", "optim.lr", "final val/loss", "best val/loss", "wall s", "status"]


@pytest.mark.parametrize(
    ("error", "line"), [(RuntimeError, "RuntimeError: boom"), (ConfigError, "error: boom")]
)
def test_a_sweep_whose_every_job_fails_records_them_and_exits_1(
    tmp_path: Path, monkeypatch, error: type[Exception], line: str
) -> None:
    # a torchkiln error is recorded by the job itself and the sweep runs to its end, which finds no job
    # completed; any other exception (a bug, an out-of-memory) is recorded by the summary callback from
    # Hydra's failed job, and the basic sweeper then ends the sweep with it, as Hydra does
    import recipes.train

    def boom(cfg: object) -> None:
        raise error("boom\nsecond line")

    monkeypatch.setattr(recipes.train, "run", boom)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        train(["-m", *TINY, "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path}/sweep"])
    assert stop.value.code == 1
    rows = _summary(tmp_path / "sweep")
    assert [(row["job"], row["status"], row["error"].split("\n")[0]) for row in rows] == [
        ("0", "failed", line),
        ("1", "failed", line),
    ]
    assert _result(tmp_path / "sweep", "1")["overrides"][-1] == "optim.lr=0.003"


@pytest.mark.parametrize("make", ["missing", "empty", "run"])
def test_report_refuses_a_directory_that_is_not_a_sweep(tmp_path: Path, capsys, make: str) -> None:
    target = tmp_path / "d"
    if make != "missing":
        target.mkdir()
    if make == "run":  # a single run's directory: its result.json is not one level down
        (target / "result.json").write_text(json.dumps({"overrides": [], "metrics": {}, "wall_s": 1}))
    assert report([str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not (target / "report.md").exists()


@pytest.mark.parametrize("task", sorted(p.stem for p in (CONF_DIR / "hparams_search").glob("*.yaml")))
def test_each_search_space_composes_and_every_bound_validates(task: str) -> None:
    text = (CONF_DIR / "hparams_search" / f"{task}.yaml").read_text()
    assert text.startswith("# @package _global_\n# ")
    assert check_overrides([f"+task={task}", f"hparams_search={task}"], multirun=True) is None


@pytest.mark.parametrize(
    ("extra", "multirun", "expected"),
    [
        ([], False, "hparams_search=image_classification runs a search of many runs; add -m"),
        (["hydra.sweeper.storage=sqlite:///s.db"], True, "hydra.sweeper.storage=sqlite:///s.db: "),
        (["trainer.monitor=val/loss"], True, "set hydra.sweeper.direction=minimize"),
        # a search range outside the key's declared Bounds (core.bounds), found before any trial
        (["model.dropout=interval(0.0, 1.0)"], True, "model.dropout=1.0 is out of range"),
    ],
)
def test_a_bad_search_is_refused_before_any_trial(extra: list[str], multirun: bool, expected: str) -> None:
    search = ["+task=image_classification", "hparams_search=image_classification"]
    err = check_overrides([*search, *extra], multirun=multirun)
    assert err is not None and expected in err


def test_a_search_without_the_optuna_extra_names_the_install(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if "optuna" in name else real(name))
    search = ["+task=image_classification", "hparams_search=image_classification"]
    err = check_overrides(search, multirun=True)
    assert err is not None and err.startswith("hparams_search=image_classification needs")
    assert "[optuna]" in err
