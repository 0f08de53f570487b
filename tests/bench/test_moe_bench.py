"""bench/moe.py: a tiny run prints a row per model and expert count, the three models of equal active
parameters, each with positive figures and the grouped row at 1.00x."""

from __future__ import annotations

import pytest

from bench import moe
from tests.helpers import run_bench


def test_a_tiny_run_prints_the_three_models_per_expert_count(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--experts=4,8", "--d-model=32", "--layers=1", "--expert-hidden=16", "--batch=1", "--context=16"]
    run_bench(moe, [*argv, "--repeats=1"], monkeypatch)
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and line != moe.HEADER]
    assert [(r[0].lstrip("| "), r[1]) for r in rows] == [
        (f"{e} (2)", m) for e in (4, 8) for m in ("grouped", "loop", "dense")
    ], out
    for group in (rows[:3], rows[3:]):
        assert len({r[2] for r in group}) == 1, out  # equal active parameters (the router's aside)
        assert group[0][4] == "1.00x" and all(float(r[3]) > 0 and float(r[5]) > 0 for r in group), out
