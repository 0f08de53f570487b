"""bench/precision_auto.py: a tiny run trains a recipe in fp32, bf16 and auto and prints auto's pick and its
throughput against the faster; step-by-step pairing, and the probe's one-time cost read from auto's line."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bench import precision_auto
from core.device import model_precision as mp
from core.device import resolve


@pytest.mark.slow  # three recipe runs in processes of their own
def test_a_tiny_run_prints_auto_against_the_faster(capsys: pytest.CaptureFixture[str]) -> None:
    figures = precision_auto.main(
        ["--recipes=image", "--steps=4", "--skip=1", "--rounds=1", "--extra=model.width=8"]
    )
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| image |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[5] in ("fp32", "bf16"), row  # what the auto run's checkpoint says it trained in
    assert set(figures) == {"image"} and math.isfinite(figures["image"]) and figures["image"] > 0
    assert "image: precision=auto:" in out


def test_paired_ratios_and_the_probe_cost_from_autos_line() -> None:
    # the same batches, one run 2x faster throughout, a step of the slower one disturbed: the pairs say 2
    assert precision_auto.paired([20.0, 200.0, 40.0, 90.0], [10.0, 100.0, 20.0, 5.0]) == pytest.approx(2.0)
    plan = dataclasses.replace(resolve("cpu", "fp32"), reasons={"precision": "machine: fp32"})
    timing = mp.ModelTiming(500.0, 250.0, 0.0, "2026-12-04T00:00:00+00:00")
    line = "precision=auto: " + mp.decide(plan, timing).reasons["precision"]
    assert precision_auto.probe_seconds(line) == pytest.approx((1 + mp.STEPS) * 0.75)
    assert precision_auto.probe_seconds("precision=auto: fp32 (resumed)") == 0.0


def test_first_calls_times_each_new_shape_and_its_repeat_in_both_dtypes() -> None:
    found = precision_auto.first_calls(shapes=3, width=16, out=32)
    assert set(found) == {"fp32", "bf16"}
    assert all(first > 0 and again > 0 for first, again in found.values())
