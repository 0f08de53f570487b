"""bench/speech_scoring.py: both sides scored, one row each and their ratio."""

from __future__ import annotations

import pytest

pytest.importorskip("whisper_normalizer")

from bench import speech_scoring  # noqa: E402
from tests.helpers import run_bench  # noqa: E402


def test_prints_raw_and_normalised_rows_and_their_ratio(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_bench(speech_scoring, ["--utterances", "4", "--words", "6", "--repeats", "1"], monkeypatch)
    out = capsys.readouterr().out
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| raw")]
    assert rows == ["raw", "raw + normalised"], out
    assert "normalised / raw: " in out and "4 utterances of 6 words" in out


def test_hypotheses_differ_from_references_in_every_fifth_word() -> None:
    (ref, hyp), *_ = speech_scoring.pairs(1, 10, seed=3)
    changed = [i for i, (a, b) in enumerate(zip(ref.split(), hyp.split(), strict=True)) if a != b]
    assert set(changed) <= {0, 5}
