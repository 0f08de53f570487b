"""Sweeps (`python -m recipes.train -m ...`): what a job hands its sweeper, the record a failed job leaves,
and the reading of a sweep directory behind `sweep_summary.csv` and `recipes.report`.

Hydra's basic sweeper runs the grid of the command line's swept values; Optuna's (`hparams_search=TASK`,
conf/hparams_search/) samples `hydra.sweeper.params` and optimizes the value each job returns. Either way
every job leaves `result.json` in its directory, status `ok` or `failed`; a job killed before writing one
reads as failed.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from core.errors import TorchkilnError
from core.files import write_text_atomic

#: the sweeper that runs a grid; any other (Optuna, Nevergrad, Ax) optimizes the value a job returns
GRID_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


class TrialFailed(Exception):
    """A job's one-line failure, raised to a sweeper that records failed trials and samples on (Optuna)."""


def in_sweep() -> bool:
    """Whether this job is one of a multirun's."""
    return HydraConfig.get().mode == RunMode.MULTIRUN


def optimizing(sweeper: Any) -> bool:
    """Whether a sweeper's config (`hydra.sweeper`) names one that optimizes a returned value."""
    return OmegaConf.select(sweeper, "_target_", default=GRID_SWEEPER) != GRID_SWEEPER


def objective(metrics: dict[str, float], monitor: str) -> float:
    """What a job returns to an optimizing sweeper: the best value of `monitor` the run reached."""
    value = metrics.get(f"best/{monitor}", metrics.get(monitor))
    if value is None or not math.isfinite(value):
        raise TrialFailed(f"the run recorded no finite {monitor}, the value the sweep optimizes")
    return float(value)


def job_failed(line: str, t0: float) -> dict[str, float]:
    """End a sweep job that failed with `line`: recorded in its result.json, then told to an optimizing
    sweeper as TrialFailed (it marks the trial failed and samples on); the basic sweeper is told nothing, as
    it ends the sweep with a failed job's exception."""
    hc = HydraConfig.get()
    record_failure(Path(hc.runtime.output_dir), line, time.perf_counter() - t0, list(hc.overrides.task))
    if optimizing(hc.sweeper):
        raise TrialFailed(line)
    return {}


def record_failure(run_dir: Path, error: str, wall_s: float, overrides: list[str]) -> None:
    """Mark a job failed in its result.json (the metrics of one already written are kept)."""
    path = run_dir / "result.json"
    old = _read_json(path) or {}
    result = {
        "status": "failed",
        "overrides": old.get("overrides", overrides),
        "metrics": old.get("metrics", {}),
        "wall_s": old.get("wall_s", round(wall_s, 2)),
        "error": error,
    }
    with contextlib.suppress(OSError):  # a full disk: the job's stderr and train.log have the error
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(result, indent=1))


class SweepSummary(Callback):
    """Keeps `sweep_summary.csv` current as jobs end, and records jobs that died of an exception as failed;
    works with any launcher (local or submitit) and sweeper (basic or Optuna)."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Keep the sweep's config beside its jobs (the basic sweeper writes this file too; Optuna's does
        not): which keys it sweeps is read from it."""
        sweep_dir = Path(config.hydra.sweep.dir)
        with contextlib.suppress(OSError):
            sweep_dir.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(config, sweep_dir / "multirun.yaml")

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Start the job's clock, for the wall seconds of a job that dies."""
        self._t0 = time.perf_counter()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        """A sweep job that raised is recorded failed; then the summary is rewritten."""
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        if job_return.status == JobStatus.FAILED:
            # the exception itself: the public `return_value` re-raises it
            error = error_line(job_return._return_value)
            run_dir = Path(config.hydra.runtime.output_dir)
            record_failure(run_dir, error, time.perf_counter() - self._t0, list(job_return.overrides or []))
        with contextlib.suppress(OSError):
            write_summary(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write sweep_summary.csv and say how the jobs ended; exit 1 when none completed."""
        sweep = read_sweep(Path(config.hydra.sweep.dir))
        path = write_summary(sweep.dir, sweep)
        if path is None:
            return
        failed = [j for j in sweep.jobs if j.status != "ok"]
        print(f"sweep summary: {path} ({len(sweep.jobs) - len(failed)} ok, {len(failed)} failed)", flush=True)
        if len(failed) == len(sweep.jobs):
            print(f"error: every job of the sweep failed; see {path}", file=sys.stderr, flush=True)
            sys.exit(1)


def error_line(exc: BaseException) -> str:
    """One line for a job's exception: a torchkiln error as the CLI prints it, else its type and message."""
    if isinstance(exc, TrialFailed):
        return str(exc)
    if isinstance(exc, TorchkilnError):
        return f"{getattr(exc, 'label', 'error')}: {exc}"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@dataclass
class Job:
    """One job of a sweep, as its directory records it."""

    name: str  # its directory, relative to the sweep's
    dir: Path
    status: str  # ok | failed
    overrides: list[str]
    metrics: dict[str, float] = field(default_factory=dict)
    wall_s: float | None = None
    error: str = ""
    #: the metric the run was judged by (trainer.monitor) and whether larger is better, if recorded
    monitor: str | None = None
    maximize: bool | None = None

    def value(self, key: str) -> str | None:
        """The value this job's overrides give `key`, as written."""
        for o in self.overrides:
            k, _, v = o.partition("=")
            if k.lstrip("+~") == key:
                return v
        return None


@dataclass
class Sweep:
    """A sweep directory read back: its jobs, the keys it swept, and the metric they were judged by."""

    dir: Path
    jobs: list[Job]
    swept: list[str]
    monitor: str | None
    maximize: bool | None
    sweeper: str | None  # "basic", "optuna", another sweeper's class name; None: no multirun.yaml

    def best(self) -> Job | None:
        """The completed job with the best value of the monitored metric (None if that is unknown)."""
        if self.monitor is None or self.maximize is None:
            return None
        scored = [j for j in self.jobs if j.status == "ok" and _finite(self.best_value(j))]
        if not scored:
            return None
        pick = max if self.maximize else min
        return pick(scored, key=lambda j: self.best_value(j))  # type: ignore[arg-type,return-value]

    def final_value(self, job: Job) -> float | None:
        """The monitored metric at the job's last evaluation."""
        return job.metrics.get(self.monitor) if self.monitor else None

    def best_value(self, job: Job) -> float | None:
        """The best value of the monitored metric the job reached."""
        if not self.monitor:
            return None
        return job.metrics.get(f"best/{self.monitor}", job.metrics.get(self.monitor))

    def fixed(self) -> list[str]:
        """The overrides every job shares, other than the swept keys'."""
        if not self.jobs:
            return []
        common = [o for o in self.jobs[0].overrides if all(o in j.overrides for j in self.jobs[1:])]
        return [o for o in common if o.partition("=")[0].lstrip("+~") not in self.swept]


def read_sweep(sweep_dir: Path) -> Sweep:
    """Read every job of `sweep_dir`: each subdirectory holding result.json or .hydra/overrides.yaml (one
    level down, as conf/train.yaml's hydra.sweep.subdir puts them)."""
    dirs = {p.parent for p in sweep_dir.glob("*/result.json")}
    dirs |= {p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")}
    jobs = sorted((_read_job(sweep_dir, d) for d in dirs), key=lambda j: _natural(j.name))
    multirun = _read_yaml(sweep_dir / "multirun.yaml")
    hydra_cfg = multirun.get("hydra", {}) if isinstance(multirun, dict) else {}
    monitor = next((j.monitor for j in jobs if j.monitor), None)
    maximize = next((j.maximize for j in jobs if j.maximize is not None), None)
    if monitor is None:  # results written before result.json named it: the run's one best/ metric
        bests = {k[5:] for j in jobs for k in j.metrics if k.startswith("best/")}
        monitor = bests.pop() if len(bests) == 1 else None
    if maximize is None:
        direction = (hydra_cfg.get("sweeper") or {}).get("direction")
        maximize = {"maximize": True, "minimize": False}.get(str(direction))
    target = str((hydra_cfg.get("sweeper") or {}).get("_target_", ""))
    sweeper = target.rsplit(".", 1)[-1] or None
    sweeper = "basic" if target == GRID_SWEEPER else "optuna" if "optuna" in target else sweeper
    return Sweep(sweep_dir, jobs, swept_keys(hydra_cfg, jobs), monitor, maximize, sweeper)


def swept_keys(hydra_cfg: dict[str, Any], jobs: list[Job]) -> list[str]:
    """The keys the sweep chose per job: those its command line or `hydra.sweeper.params` gave a sweep
    (choice, range, interval) and the command line did not fix, then any other whose value differs
    between jobs."""
    parser = OverridesParser.create()
    declared: list[str] = []
    fixed: set[str] = set()
    params = (hydra_cfg.get("sweeper") or {}).get("params") or {}
    command_line = (hydra_cfg.get("overrides") or {}).get("task") or []
    for line in [f"{k}={v}" for k, v in params.items()] + list(command_line):
        with contextlib.suppress(Exception):  # a line Hydra's parser refuses is no sweep of ours
            o = parser.parse_override(line)
            key = o.get_key_element().lstrip("+~")
            if o.is_sweep_override():
                declared += [key] if key not in declared else []
                fixed.discard(key)
            else:
                fixed.add(key)
    keys = [k for k in declared if k not in fixed]
    given = dict.fromkeys(o.partition("=")[0].lstrip("+~") for j in jobs for o in j.overrides)
    keys += [k for k in given if k not in keys and len({j.value(k) for j in jobs}) > 1]
    return keys


def summary_rows(sweep: Sweep) -> list[dict[str, Any]]:
    """One row per job: job, status, the swept keys, wall seconds, the monitored metric (final, best), the
    other metrics, the error of a failed job and the job's overrides."""
    rows = []
    for j in sweep.jobs:
        row: dict[str, Any] = {"job": j.name, "status": j.status}
        row.update({k: j.value(k) for k in sweep.swept})
        row["wall_s"] = j.wall_s
        if sweep.monitor:
            row[sweep.monitor] = sweep.final_value(j)
            row[f"best/{sweep.monitor}"] = sweep.best_value(j)
        row.update({k: v for k, v in j.metrics.items() if k not in row})
        row["error"] = j.error
        row["overrides"] = " ".join(j.overrides)
        rows.append(row)
    return rows


def write_summary(sweep_dir: Path, sweep: Sweep | None = None) -> Path | None:
    """Write `sweep_summary.csv` (summary_rows) into `sweep_dir`; None when it holds no job yet."""
    sweep = sweep or read_sweep(sweep_dir)
    rows = summary_rows(sweep)
    if not rows:
        return None
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    # error and overrides last: long text after the numbers
    cols = [c for c in cols if c not in ("error", "overrides")] + ["error", "overrides"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)
    out = sweep_dir / "sweep_summary.csv"
    write_text_atomic(out, buf.getvalue())  # whole or not at all: jobs on a cluster may end together
    return out


def _read_job(sweep_dir: Path, d: Path) -> Job:
    name = d.relative_to(sweep_dir).as_posix()
    result = _read_json(d / "result.json")
    overrides = _read_yaml(d / ".hydra" / "overrides.yaml")
    overrides = [str(o) for o in overrides] if isinstance(overrides, list) else []
    if result is None:
        last = _last_line(d / "train.log")
        why = "no result.json: the job was killed or is still running"
        return Job(name, d, "failed", overrides, error=f"{why}; train.log ends: {last}" if last else why)
    monitor = result.get("monitor") or {}
    return Job(
        name,
        d,
        result.get("status", "ok"),
        [str(o) for o in result.get("overrides", overrides)],
        {k: v for k, v in (result.get("metrics") or {}).items() if isinstance(v, (int, float))},
        result.get("wall_s"),
        result.get("error", ""),
        monitor.get("key"),
        {"max": True, "min": False}.get(monitor.get("mode")),
    )


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1].strip() if lines else ""
    return ""


def _natural(name: str) -> list[Any]:
    """Sort key that puts job 10 after job 9."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name) if t]


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)
