"""`python -m recipes.report SWEEP_DIR`: a sweep's runs side by side, written into SWEEP_DIR.

`report.md`: one row per job (one column per swept key, the monitored metric's final and best values, each
benchmark's last score where trainer.evals logged one, wall seconds, status; the best run marked),
`report_curves.png`: each run's monitored metric against step, `report_params.png`: the final metric against
each swept key. Reads what the jobs left (recipes.cli.sweep), so it works for the basic and the Optuna
sweeper, during a sweep, and for jobs that died without a result.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recipes.cli.curves import PANEL_PX, read_rows, y_scale
from recipes.cli.sweep import Job, Sweep, read_sweep

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_DPI = 100
_BEST = "★"
#: a sweep of more jobs than this names only its best in the curves' legend
_LEGEND_MAX = 20
#: the prefix of a benchmark's centred score, (x - baseline) / (1 - baseline) (text.harness.training_evals)
_CENTRED = "centered_"


def write_report(sweep: Sweep, out_dir: Path) -> list[Path]:
    """Write report.md, report_curves.png and report_params.png into `out_dir`; their paths."""
    paths = [out_dir / "report.md", out_dir / "report_curves.png", out_dir / "report_params.png"]
    paths[0].write_text(markdown(sweep, curves=paths[1].name, params=paths[2].name), encoding="utf-8")
    sweep_curves_figure(sweep).savefig(paths[1], format="png")
    params_figure(sweep).savefig(paths[2], format="png")
    return paths


def markdown(sweep: Sweep, *, curves: str, params: str) -> str:
    """The report's text: what was swept and judged, the table, the plots, each failed job's error."""
    best = sweep.best()
    failed = [j for j in sweep.jobs if j.status != "ok"]
    metric = sweep.monitor or "the monitored metric"
    better = {True: "higher is better", False: "lower is better"}.get(sweep.maximize, "direction unknown")
    lines = [
        f"# Sweep report: `{sweep.dir}`",
        "",
        f"{len(sweep.jobs)} jobs ({len(sweep.jobs) - len(failed)} ok, {len(failed)} failed)"
        + (f", {sweep.sweeper} sweeper" if sweep.sweeper else "")
        + f"; judged by {metric} ({better}).",
    ]
    if best is not None:
        shown = ", ".join(f"{k}={_value(best.value(k))}" for k in sweep.swept) or "no swept keys"
        value = _num(sweep.best_value(best))
        lines += ["", f"Best {_BEST}: job {best.name}, best {metric} {value} ({shown})."]
    if sweep.fixed():
        lines += ["", "Every job: `" + " ".join(sweep.fixed()) + "`"]
    lines += ["", *_table(sweep, best, metric)]
    lines += ["", f"![each run's {metric} against step]({curves})", ""]
    lines += [f"![final {metric} against each swept key]({params})"]
    if failed:
        lines += ["", "## Failed jobs", ""]
        lines += [f"- job {j.name}: {j.error or 'no error recorded'}" for j in failed]
    return "\n".join(lines) + "\n"


def _table(sweep: Sweep, best: Job | None, metric: str) -> list[str]:
    """The table's lines: a row per job; a column per swept key, the monitored metric's final and best
    values, then each benchmark metric some job logged (trainer.evals: its last value, '' where not)."""
    benchmarks = {j.name: last_benchmarks(j) for j in sweep.jobs}
    columns = benchmark_columns(benchmarks.values())
    head = ["job", *sweep.swept, f"final {metric}", f"best {metric}", *columns, "wall s", "status"]
    lines = ["| " + " | ".join(_cell(h) for h in head) + " |", "|" + "---|" * len(head)]
    for j in sweep.jobs:
        row = [
            f"{j.name} {_BEST}" if j is best else j.name,
            *(_value(j.value(k)) for k in sweep.swept),
            _num(sweep.final_value(j)),
            _num(sweep.best_value(j)),
            *(_num(benchmarks[j.name].get(c), ".4g") for c in columns),
            _num(j.wall_s, ".1f"),
            j.status,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return lines


def last_benchmarks(job: Job) -> dict[str, float]:
    """The last value of each eval/<task>/<metric> (trainer.evals) the job logged: its metrics.jsonl's
    rows over its result.json's metrics, since trainer.evals_every may skip the final evaluation."""
    out = {k: v for k, v in job.metrics.items() if k.startswith("eval/") and _finite(v)}
    if (job.dir / "metrics.jsonl").is_file():
        for row in read_rows(job.dir / "metrics.jsonl"):
            out.update((k, v) for k, v in row.items() if k.startswith("eval/") and _finite(v))
    return out


def benchmark_columns(logged: Iterable[dict[str, float]]) -> list[str]:
    """The benchmark metrics the report shows, sorted: every eval/* score some job logged, a metric's centred
    score (eval/<task>/centered_<metric>, comparable across tasks) in place of the raw one where logged."""
    # sample_len is lm-eval's count of documents scored (trainer.evals_limit), not a score
    keys = {k for metrics in logged for k in metrics if not k.endswith("/sample_len")}
    raw = {k.replace(f"/{_CENTRED}", "/") for k in keys if f"/{_CENTRED}" in k}
    return sorted(keys - raw)


def sweep_curves_figure(sweep: Sweep) -> Figure:
    """One panel: each job's monitored metric against optimizer step (failed jobs dashed, the best thick)."""
    fig, (ax,) = _figure(1, f"each run's {sweep.monitor or 'monitored metric'}\n{sweep.dir}")
    best = sweep.best()
    values: list[float] = []
    for j in sweep.jobs:
        pts = _monitored(j, sweep.monitor)
        if not pts:
            continue
        xs, ys = zip(*pts, strict=True)
        values += ys
        failed = j.status != "ok"
        style = {"linestyle": "--" if failed else "-", "linewidth": 3 if j is best else 1.3}
        label = f"job {j.name}" + (f" {_BEST} best" if j is best else "") + (" failed" if failed else "")
        if len(sweep.jobs) > _LEGEND_MAX and j is not best:
            label = "_nolegend_"  # matplotlib leaves it out of the legend
        ax.plot(xs, ys, label=label, marker="o" if len(pts) < 40 else None, ms=3, **style)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(sweep.monitor or "")
    if values:
        ax.set_yscale(y_scale(values))
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncols=4, fontsize=8, frameon=False)
    else:
        _no_data(ax, "no evaluation recorded")
    ax.grid(True, alpha=0.4)
    return fig


def params_figure(sweep: Sweep) -> Figure:
    """One panel per swept key: each completed job's final monitored metric against the key's value (log x
    past one decade, the same rule as curves.png's y), the best starred."""
    keys = sweep.swept or [""]
    done = [j for j in sweep.jobs if j.status == "ok" and _finite(sweep.final_value(j))]
    title = f"final {sweep.monitor or 'monitored metric'} against each swept key"
    n_failed = sum(j.status != "ok" for j in sweep.jobs)
    title += f" ({n_failed} failed, not shown)" if n_failed else ""
    fig, axes = _figure(len(keys), f"{title}\n{sweep.dir}")
    best = sweep.best()
    for ax, key in zip(axes, keys, strict=True):
        ax.set_title(key or "(no swept keys)", fontsize=10)
        ax.set_ylabel(f"final {sweep.monitor or ''}")
        ax.grid(True, alpha=0.4)
        xs = [_number(j.value(key)) for j in done] if key else []
        if not done or not key:
            _no_data(ax, "no completed run" if key else "nothing was swept")
            continue
        ys = [float(sweep.final_value(j)) for j in done]  # type: ignore[arg-type]
        if all(x is not None for x in xs):
            ax.set_xscale(y_scale(xs))  # type: ignore[arg-type]
        else:  # words (a model's name): one slot per value, in the order met
            names = list(dict.fromkeys(str(j.value(key)) for j in done))
            xs = [float(names.index(str(j.value(key)))) for j in done]
            ax.set_xticks(range(len(names)), names)
        ax.scatter(xs, ys, s=30)
        for i in (i for i, j in enumerate(done) if j is best):
            ax.plot([xs[i]], [ys[i]], linestyle="none", marker="*", ms=14, color="gold", mec="black")
        ax.set_xlabel(key)
    return fig


def _figure(panels: int, title: str) -> tuple[Figure, list[Any]]:
    # Figure + FigureCanvasAgg, not pyplot (recipes.cli.curves says why); imported here, as there
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = min(panels, 3)
    nrows = math.ceil(panels / ncols)
    w, h = PANEL_PX
    fig = Figure(figsize=(ncols * w / _DPI, nrows * h / _DPI + 0.6), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=11)
    return fig, [fig.add_subplot(nrows, ncols, i + 1) for i in range(panels)]


def _monitored(job: Job, metric: str | None) -> list[tuple[float, float]]:
    if metric is None or not (job.dir / "metrics.jsonl").is_file():
        return []
    return [(r["step"], r[metric]) for r in read_rows(job.dir / "metrics.jsonl") if _finite(r.get(metric))]


def _no_data(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")


def _number(text: str | None) -> float | None:
    try:
        v = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _value(text: str | None) -> str:
    """A swept value as the table shows it: numbers to 4 significant digits, words as given."""
    v = _number(text)
    return "" if text is None else _num(v, ".4g") if v is not None else text


def _num(v: float | None, fmt: str = ".6g") -> str:
    return "" if v is None else format(v, fmt)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: 0 with the written paths, 2 and one line for a directory that is not a sweep."""
    p = argparse.ArgumentParser(prog="python -m recipes.report", description=__doc__.splitlines()[0])
    p.add_argument("sweep_dir", type=Path, help="a multirun directory, e.g. multirun/<task>/<time>")
    args = p.parse_args(argv)
    sweep_dir: Path = args.sweep_dir
    if not sweep_dir.is_dir():
        why = "is not a directory; give a sweep's, e.g. multirun/<task>/<time>"
        print(f"error: {sweep_dir} {why}", file=sys.stderr)
        return 2
    sweep = read_sweep(sweep_dir)
    if not sweep.jobs:
        print(
            f"error: {sweep_dir} holds no jobs (no */result.json or */.hydra/overrides.yaml); give a sweep's "
            "directory, e.g. multirun/<task>/<time>",
            file=sys.stderr,
        )
        return 2
    try:
        paths = write_report(sweep, sweep_dir)
    except OSError as e:
        print(f"error: cannot write the report into {sweep_dir}: {e.strerror or e}", file=sys.stderr)
        return 74
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
