"""bench/precision_auto.py: a tiny run trains a recipe in fp32, bf16 and auto and prints auto's pick and its
throughput against the faster."""

from __future__ import annotations

import math

import pytest

from bench import precision_auto


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
