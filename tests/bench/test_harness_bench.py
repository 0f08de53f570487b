"""bench/harness.py: both sides score the same folder and tasks, one row per request type and one in all."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")

from bench import harness  # noqa: E402
from tests.helpers import run_bench  # noqa: E402


@pytest.mark.slow  # two lm-eval evaluations a side (warm-up and the timed round) of a tiny model
def test_a_tiny_run_prints_each_request_type_and_the_ratio(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = ["model.n_layer=1", "model.n_head=2", "model.n_kv_head=1", "model.d_model=16", "task.context=32"]
    run_bench(harness, ["--docs", "4", "--repeats", "1", "--threads", "1", *tiny], monkeypatch)
    out = capsys.readouterr().out
    assert "Llama 1 layers x 16 wide, context 32" in out
    rows = {
        line.split(" (")[0].strip("| ")
        for line in out.splitlines()
        if line.startswith("| ") and "x |" in line
    }
    assert rows == {"loglikelihood", "generate_until", "loglikelihood_rolling", "all"}, out
    # 4 documents x 3 choices, 2 generations, 2 rolling texts
    assert "| loglikelihood (12) |" in out and "| all (16) |" in out
