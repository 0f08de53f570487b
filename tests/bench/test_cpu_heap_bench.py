"""bench/cpu_heap.py: a tiny run trains a recipe under both heap policies and prints the paired ratio, the
page faults and peak memory of each; one page fault's cost is measured."""

from __future__ import annotations

import math
import platform

import pytest

from bench import cpu_heap


@pytest.mark.slow  # two recipe runs in processes of their own
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the retain policy is glibc's")
def test_a_tiny_run_prints_both_policies(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--recipes=image", "--steps=4", "--skip=1", "--rounds=1", "--extra=model.width=8"]
    figures = cpu_heap.main(args)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| image |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert set(figures) == {"image"} and math.isfinite(figures["image"]) and figures["image"] > 0
    assert all(float(c) > 0 for c in cells[3:7]), row  # faults a step and peak MiB of each policy


def test_a_page_fault_costs_a_positive_finite_time() -> None:
    cost = cpu_heap.fault_cost_us(mib=8, reps=3)
    assert math.isfinite(cost) and 0 < cost < 1000
