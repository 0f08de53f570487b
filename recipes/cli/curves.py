"""Draw a run's learning curves (from `metrics.jsonl`) into `curves.png` with matplotlib's Agg canvas."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: one panel's size in pixels (at _DPI); the figure is a grid of them
PANEL_PX = (600, 400)
_DPI = 100
#: a series with fewer points than this also gets a dot per point (validation runs once per epoch)
_DOTS_BELOW = 40

Series = list[tuple[float, float]]


def write_curves(run_dir: Path, primary_metric: str) -> Path | None:
    """Plot RUN_DIR/metrics.jsonl (loss, `primary_metric` e.g. val/wer, other val/*, lr) into curves.png."""
    fig = curves_figure(run_dir, primary_metric)
    if fig is None:
        return None
    out = run_dir / "curves.png"
    fig.savefig(out, format="png")
    return out


def curves_figure(run_dir: Path, primary_metric: str) -> Figure | None:
    """The figure `write_curves` saves; None when the run has no metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = read_rows(path)
    panels = _panels(rows, primary_metric)
    # Figure + FigureCanvasAgg, not pyplot: no global backend switch, no figure registry, safe off the main
    # thread; imported here so runs that never draw do not pay matplotlib's import
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = 2 if len(panels) == 4 else len(panels)
    nrows = math.ceil(len(panels) / ncols)
    w, h = PANEL_PX
    fig = Figure(figsize=(ncols * w / _DPI, nrows * h / _DPI), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(run_title(run_dir), fontsize=11)
    best = _best(rows, primary_metric)
    for i, (title, series) in enumerate(panels.items()):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        _draw_panel(ax, title, series, best if primary_metric in series else None, primary_metric)
    return fig


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; unparseable lines (the torn last line of a killed run) are skipped."""
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict) and _is_number(row.get("step")):
                rows.append(row)
    return rows


def y_scale(values: list[float]) -> str:
    """'log' when positive values span more than one decade (a loss falling from 2 to 0.002 would
    otherwise lie flat after the first steps), else 'linear'."""
    if not values or min(values) <= 0:
        return "linear"
    return "log" if max(values) / min(values) > 10 else "linear"


def run_title(run_dir: Path) -> str:
    """'task T, model M' from RUN_DIR/.hydra/config.yaml over the run dir; the dir's name when unknown."""
    names = []
    with contextlib.suppress(OSError, yaml.YAMLError):
        cfg = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text(encoding="utf-8"))
        for group in ("task", "model"):
            part = cfg.get(group) if isinstance(cfg, dict) else None
            if isinstance(part, dict) and part.get("name"):
                names.append(f"{group} {part['name']}")
    return f"{', '.join(names)}\n{run_dir}" if names else f"{run_dir.name}\n{run_dir}"


def describe(fig: Figure) -> dict[str, Any]:
    """What `fig` shows, read back from its artists: title, size, and per panel its y scale, legend labels,
    x label and whether a grid is drawn (for tests and for reading a figure without looking at it)."""
    panels = {}
    for ax in fig.axes:
        legend = ax.get_legend()
        panels[ax.get_title()] = {
            "yscale": ax.get_yscale(),
            "series": [t.get_text() for t in legend.get_texts()] if legend else [],
            "xlabel": ax.get_xlabel(),
            "grid": any(line.get_visible() for line in ax.get_ygridlines()),
        }
    w, h = fig.get_size_inches() * fig.dpi
    return {"title": fig.get_suptitle(), "size_px": (round(w), round(h)), "panels": panels}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _series(rows: list[dict[str, Any]], key: str) -> Series:
    return [(r["step"], r[key]) for r in rows if _is_number(r.get(key))]


def _panels(rows: list[dict[str, Any]], primary: str) -> dict[str, dict[str, Series]]:
    """Panel title -> series name -> points. Loss and the headline metric always get a panel (an empty one
    says 'no data yet'); other val/* metrics, benchmarks (eval/*) and the learning rate only when logged."""
    keys = {k for r in rows for k, v in r.items() if _is_number(v)}
    panels = {"loss": {k: _series(rows, k) for k in ("train/loss", "val/loss")}}
    if primary != "val/loss":
        panels[f"{primary} (headline)"] = {primary: _series(rows, primary)}
    others = sorted(k for k in keys if k.startswith("val/") and k not in ("val/loss", primary))
    if others:
        panels["other validation metrics"] = {k: _series(rows, k) for k in others}
    benchmarks = sorted(k for k in keys if k.startswith("eval/"))  # trainer.evals
    if benchmarks:
        panels["benchmarks"] = {k: _series(rows, k) for k in benchmarks}
    if "train/lr" in keys:
        panels["learning rate"] = {"train/lr": _series(rows, "train/lr")}
    return panels


def _best(rows: list[dict[str, Any]], metric: str) -> tuple[float, float] | None:
    """(step, value) where `metric` first reached the best value the trainer logged as best/<metric>; the
    trainer knows whether higher is better (Task.maximize), so the direction is not guessed here."""
    logged = _series(rows, f"best/{metric}")
    if not logged:
        return None
    best = logged[-1][1]
    return next(((s, v) for s, v in _series(rows, metric) if v == best), None)


def _draw_panel(
    ax: Any, title: str, series: dict[str, Series], best: tuple[float, float] | None, metric: str
) -> None:
    """One panel: a line per series, log or linear y by the data, grid, labelled axes, legend below."""
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("optimizer step")
    values = [v for pts in series.values() for _, v in pts]
    if not values:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.grid(True, alpha=0.3)
        return
    ax.set_yscale(y_scale(values))
    for name, pts in series.items():
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, label=name, linewidth=1.5, marker="o" if len(pts) < _DOTS_BELOW else None, ms=3)
    if best is not None:
        step, value = best
        label = f"best {metric} {value:.4g} @ step {step:g}"
        ax.plot([step], [value], linestyle="none", marker="*", ms=13, color="gold", mec="black", label=label)
    ax.grid(True, which="major", alpha=0.4)
    if ax.get_yscale() == "log":
        from matplotlib.ticker import LogFormatterSciNotation

        # label some minor ticks up to two decades: by default a 1.5-decade lr schedule shows two labels
        ax.yaxis.set_minor_formatter(LogFormatterSciNotation(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        ax.grid(True, which="minor", alpha=0.15)
    # below the axes, so it never covers the data (loc="best" may still land on a curve and is slow on
    # long series)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=2, fontsize=8, frameon=False)
