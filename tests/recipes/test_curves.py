"""recipes.cli.curves: curves.png from a real metrics.jsonl, checked through what the figure's artists
show."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from PIL import Image

from recipes.cli.curves import PANEL_PX, curves_figure, describe, write_curves, y_scale

STEPS = 300


def write_run(
    run: Path, *, loss_decades: float = 3.0, config: bool = True, maximize: bool = True, metric: str = "acc"
) -> Path:
    """A run dir as recipes.train leaves it: train rows every step (loss falling `loss_decades` decades,
    warmup + cosine lr), a val row every 50 steps with the trainer's best/<metric>, .hydra/config.yaml."""
    run.mkdir(parents=True)
    if config:
        (run / ".hydra").mkdir()
        (run / ".hydra" / "config.yaml").write_text(
            "task:\n  name: image_classification\nmodel:\n  name: small_cnn\n  width: 32\n"
        )
    rows, best = [], None
    for s in range(1, STEPS + 1):
        lr = 3e-3 * min(1.0, s / 30) * (0.05 + 0.475 * (1 + math.cos(math.pi * s / STEPS)))
        loss = 2.3 * 10 ** (-loss_decades * s / STEPS)
        rows.append({"step": s, "time": 0.0, "epoch": 0, "train/lr": lr, "train/loss": loss})
        if s % 50 == 0:
            v = 1 - 0.9 * math.exp(-s / 100) if maximize else 0.9 * math.exp(-s / 100)
            best = v if best is None else (max if maximize else min)(best, v)
            key = f"val/{metric}"
            rows.append({"step": s, "val/loss": 2 * loss, key: v, "val/top5": 0.99, f"best/{key}": best})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_a_run_gets_loss_headline_other_val_and_lr_panels(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    out = write_curves(run, "val/acc")
    assert out == run / "curves.png"
    with Image.open(out) as img:  # 4 panels in a 2 x 2 grid
        assert img.format == "PNG" and img.size == (2 * PANEL_PX[0], 2 * PANEL_PX[1])
        img.verify()
    fig = describe(curves_figure(run, "val/acc"))
    assert "image_classification" in fig["title"] and "small_cnn" in fig["title"] and str(run) in fig["title"]
    panels = fig["panels"]
    assert list(panels) == ["loss", "val/acc (headline)", "other validation metrics", "learning rate"]
    assert panels["loss"]["series"] == ["train/loss", "val/loss"]
    assert panels["loss"]["yscale"] == "log"  # 3 decades
    assert panels["val/acc (headline)"]["yscale"] == "linear"
    assert panels["other validation metrics"]["series"] == ["val/top5"]
    assert panels["learning rate"]["series"] == ["train/lr"]
    assert all(p["xlabel"] == "optimizer step" and p["grid"] for p in panels.values())
    best = 1 - 0.9 * math.exp(-STEPS / 100)
    assert panels["val/acc (headline)"]["series"] == ["val/acc", f"best val/acc {best:.4g} @ step {STEPS}"]


def test_a_flat_loss_is_linear(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", loss_decades=0.5)
    assert describe(curves_figure(run, "val/acc"))["panels"]["loss"]["yscale"] == "linear"


def test_the_best_marker_follows_the_trainers_best_for_a_lower_is_better_metric(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", maximize=False, metric="wer")
    series = describe(curves_figure(run, "val/wer"))["panels"]["val/wer (headline)"]["series"]
    assert series[1] == f"best val/wer {0.9 * math.exp(-STEPS / 100):.4g} @ step {STEPS}"


def test_val_loss_as_headline_is_marked_in_the_loss_panel(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", maximize=False, metric="loss")
    panels = describe(curves_figure(run, "val/loss"))["panels"]
    assert "val/loss (headline)" not in panels
    assert panels["loss"]["series"][:2] == ["train/loss", "val/loss"]
    assert panels["loss"]["series"][2].startswith("best val/loss ")


def test_without_hydra_config_the_title_names_the_run_dir(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run_42", config=False)
    assert describe(curves_figure(run, "val/acc"))["title"].splitlines()[0] == "run_42"


def test_an_empty_or_missing_metrics_file(tmp_path: Path) -> None:
    assert write_curves(tmp_path, "val/acc") is None
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/lo')  # a run killed mid-first-line
    out = write_curves(tmp_path, "val/acc")
    with Image.open(out) as img:
        assert img.format == "PNG" and img.size == (2 * PANEL_PX[0], PANEL_PX[1])
    panels = describe(curves_figure(tmp_path, "val/acc"))["panels"]
    assert {k: p["series"] for k, p in panels.items()} == {"loss": [], "val/acc (headline)": []}


@pytest.mark.parametrize(
    ("values", "scale"),
    [
        ([2.3, 0.002], "log"),
        ([2.3, 0.5], "linear"),
        ([1.0, 0.0], "linear"),
        ([-1.0, 100.0], "linear"),
        ([], "linear"),
    ],
)
def test_y_scale_is_log_past_one_decade_of_positive_values(values: list[float], scale: str) -> None:
    assert y_scale(values) == scale
