"""bench/generate.py: builds the lm recipe's model from conf/ and prints one row per path, all token-equal."""

from __future__ import annotations

import pytest

from bench import generate
from tests.helpers import run_bench


def test_a_tiny_run_prints_every_path_with_equal_tokens(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = ["model.n_layer=1", "model.n_head=2", "model.d_model=16", "task.context=16"]
    run_bench(generate, ["--new-tokens", "12", "--repeats", "1", "--threads", "1", *tiny], monkeypatch)
    out = capsys.readouterr().out
    assert "1 layers x 2 heads x 16 wide, context 16" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "ms/token" not in line]
    assert len(rows) == 4 and all(" | itself |" in r or " | yes: " in r for r in rows), out
