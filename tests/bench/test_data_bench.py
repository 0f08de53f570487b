"""bench/data.py: a tiny run prints every part's rows, each with positive, finite figures and a ratio."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import data

TINY = [
    "--memory-log2=15,16",
    "--memory-batches=3",
    "--keep-cache",  # a test leaves the machine's page cache alone
    "--prepare-mb=0.3",
    "--file-mb=0.05",
    "--loader-batches=10",
    "--steps=1",
    "model.n_layer=1",
    "model.n_head=2",
    "model.d_model=16",
    "task.context=16",
    "trainer.batch_size=4",
]


@pytest.mark.slow  # a tiny run of every part (~8 s on 2 loaded cores): a bench's own check
def test_a_tiny_run_prints_each_part_with_positive_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figures = data.main([*TINY, f"--workdir={tmp_path}"])
    out = capsys.readouterr().out
    assert out.startswith("command: python -m bench.data --memory-log2=15,16"), out
    assert "host: " in out and "usable cores" in out, out
    lines = out.splitlines()
    assert data.HEADER in lines, out
    parts = ["loader vs step"] * 2 + ["memory"] * 2 + ["memory, anonymous"] * 2 + ["prepare"] * 2
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and line != data.HEADER]
    assert [r[0].lstrip("| ") for r in rows] == parts, out
    assert all(len(r) == 5 for r in rows), out
    assert [r[3] for r in rows] == ["tokens/s"] * 2 + ["MiB peak RSS"] * 2 + ["MiB RssAnon"] * 2 + [
        "MB/s"
    ] * 2, out
    for r in rows:
        figure = float(r[2].rstrip(" kM").replace(",", ""))
        ratio = float(r[4].split("x")[0].replace(",", ""))
        assert math.isfinite(figure) and figure > 0 and math.isfinite(ratio) and ratio > 0, r
    assert "2^15 bytes of text" in rows[2][1] and "2^16 bytes of text" in rows[3][1], out
    assert set(figures) == {
        "prepare_mb_s_1",
        "prepare_mb_s_2",
        "loader_tokens_s",
        "step_tokens_s",
        "peak_rss_mib_2^15",
        "peak_rss_mib_2^16",
        "anon_rss_mib_2^15",
        "anon_rss_mib_2^16",
    }
    assert all(math.isfinite(v) and v > 0 for v in figures.values()), figures
    assert not list(tmp_path.iterdir()), "the corpora are removed at the end"


def test_a_ratio_below_one_keeps_its_digits() -> None:
    # a loader slower than a tiny model's step once printed "0x", which reads as no loader at all
    assert [data._times(r) for r in (0.004821, 0.48, 3.14159, 12.6, 1234.0)] == [
        "0.00482x",
        "0.48x",
        "3.14x",
        "13x",
        "1,234x",
    ]
