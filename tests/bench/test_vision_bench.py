"""bench/vision.py: every variant's step trains the same model; the script prints one row per variant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.vision import make_step

ROOT = Path(__file__).resolve().parents[2]


def test_every_layout_and_precision_steps_the_same_model_on_the_same_batch() -> None:
    # one seed, batch and update rule: the first step's loss is the same whatever the layout (fp32: only the
    # convolutions' summation order differs) and close under bf16 autocast (bf16's 8-bit mantissa)
    eager, model = make_step("small_cnn", "eager", "fp32", 8, 1, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = eager()
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items() if v.is_floating_point())
    assert make_step("small_cnn", "channels_last", "fp32", 8, 1, 4)[0]() == pytest.approx(loss, rel=1e-5)
    assert make_step("small_cnn", "eager", "bf16", 8, 1, 4)[0]() == pytest.approx(loss, rel=2e-2)
    layout = make_step("small_cnn", "channels_last", "fp32", 8, 1, 4)[1]
    assert next(layout.parameters()).is_contiguous(memory_format=torch.channels_last)


def test_bench_prints_a_row_per_variant_and_precision() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.vision", "--models", "small_cnn", "--variants", "eager,channels_last"]
    cmd += ["--size", "8", "--channels", "1", "--batch", "4", "--steps", "1", "--warmup", "0"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    got = {(r["variant"], r["precision"]) for r in rows}
    assert got == {(v, p) for v in ("eager", "channels_last") for p in ("fp32", "bf16")}
    assert all(r["images_per_s"] > 0 for r in rows)
    assert [r["vs_eager_fp32"] for r in rows if (r["variant"], r["precision"]) == ("eager", "fp32")] == [1.0]
