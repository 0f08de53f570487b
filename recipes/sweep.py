"""Hydra callback that writes `sweep_summary.csv` (one row per run) at the end of a multirun."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepSummary(Callback):
    """Collects each job's `result.json` from the sweep dir; works with any launcher (local or submitit)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write sweep_summary.csv into the sweep directory."""
        sweep_dir = Path(config.hydra.sweep.dir)
        path = write_summary(sweep_dir)
        if path is not None:
            print(f"sweep summary: {path}", flush=True)


def write_summary(sweep_dir: Path) -> Path | None:
    """Gather `*/result.json` under `sweep_dir` into `sweep_summary.csv`; None when no job finished."""
    rows = []
    for f in sorted(sweep_dir.glob("*/result.json"), key=lambda p: (len(p.parent.name), p.parent.name)):
        r = json.loads(f.read_text())
        rows.append(
            {
                "job": f.parent.name,
                "overrides": " ".join(r["overrides"]),
                "wall_s": r["wall_s"],
                "status": r.get("status", "ok"),
                **r["metrics"],
            }
        )
    if not rows:
        return None
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    out = sweep_dir / "sweep_summary.csv"
    with out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    return out
