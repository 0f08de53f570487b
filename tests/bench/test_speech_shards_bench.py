"""bench/speech_shards.py: a tiny run prints the table and returns a positive, finite ratio per row."""

from __future__ import annotations

import math

import pytest

from bench import speech_shards


def test_a_tiny_run_prints_a_row_per_worker_count(capsys: pytest.CaptureFixture[str]) -> None:
    figures = speech_shards.main(["--clips=12", "--rounds=1", "--workers=0", "--shard-mb=0.5", "--no-cold"])
    out = capsys.readouterr().out
    assert "| workers | cache | folder clips/s | shards clips/s | shards / folder |" in out, out
    rows = [line for line in out.splitlines() if line.startswith("| 0 | warm |")]
    assert len(rows) == 1, out
    assert set(figures) == {"prepare_mb_s", "warm_w0"}
    assert all(math.isfinite(v) and v > 0 for v in figures.values()), figures
