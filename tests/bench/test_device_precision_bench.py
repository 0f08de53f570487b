"""bench/device_precision.py: the recipe column reads each task's config, and the script runs end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.device_precision import RECIPE_MODELS, recipe_precision

ROOT = Path(__file__).resolve().parents[2]


def test_recipe_precision_follows_the_task_configs() -> None:
    # no recipe pins a precision any more (precision=auto measures the model): each follows auto's choice
    assert {recipe_precision(m, "bf16") for m in RECIPE_MODELS} == {"bf16"}
    assert recipe_precision("transformer8", "fp32") == "fp32"  # not a recipe model: auto's choice


@pytest.mark.slow  # times every model at two precisions (~9 s on 2 loaded cores): a bench's own check
def test_bench_prints_one_row_per_model_with_auto_against_the_best(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHKILN_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.device_precision",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--models",
            "small_cnn",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    header = cells(next(line for line in lines if line.startswith("| model |")))
    row = dict(
        zip(header, cells(next(line for line in lines if line.startswith("| small_cnn |"))), strict=True)
    )
    assert row["auto"] in ("fp32", "bf16") and 0 < float(row["auto vs best"]) <= 1.0
    assert list(tmp_path.rglob("precision-probe-*.json"))  # the bench's plan came from a real measurement
