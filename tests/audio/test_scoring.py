"""WER and CER, raw and after Whisper's English normaliser (`audio.scoring`), against jiwer's on tricky
pairs; the normaliser against transformers' copy of Whisper's; the normalised rates skipped, with one
warning, when whisper-normalizer is missing (the ASR evaluation's `Scores` too)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from importlib.resources import files

import pytest
import torch

from audio.asr_decoding import Scores
from audio.ctc import CharTokenizer, cer, wer
from audio.scoring import COUNTS, NORMALIZED, UtteranceScores, english_normalizer

# (reference, hypothesis): an empty hypothesis, insertions, numbers spelt and written, British spellings,
# punctuation and casing, contractions and titles, fillers, a reference the normaliser empties
PAIRS = [
    ("the cat sat", ""),
    ("go left", "go go left now"),
    ("twenty five dollars", "$25"),
    ("two five", "twenty five"),
    ("she paid one hundred and five pounds", "she paid 105 pounds"),
    ("the colour of the theatre", "the color of the theater"),
    ("Hello, World!", "hello world"),
    ("it's mr smith's", "it is mister smith is"),
    ("um i think so uh", "i think so"),
    ("OK.", "okay"),
    ("uh", "a"),
]
#: a pair with whitespace at the ends: jiwer's CER strips it first, ours counts it (see test below)
SPACED = ("  spaced   out ", "spaced out")
SENTENCES = [
    "Mr. and Mrs. Smith paid $1,250.50 for 3 tickets on the 21st of March, 1998!",
    "The colour grey; organise the theatre's catalogue, won't you? He'd've gone.",
    "Um, we saw twenty-five, uh, maybe one hundred and one [noise] (laughs) hmm birds in the 1960s.",
    "it's two point five percent of a million and a half, St. John's 2nd Avenue, 10:30 p.m.",
    "café naïve coöperate Œuvre — æsthetic ½ three quarters",
    "one oh one, double zero seven, the first, second and twelfth",
]


@pytest.fixture
def normalize():
    """Whisper's English normaliser (the test skips without whisper-normalizer)."""
    pytest.importorskip("whisper_normalizer")
    return english_normalizer()


@pytest.fixture
def without_whisper_normalizer(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """whisper_normalizer unimportable, `english_normalizer`'s cached answer forgotten before and after."""
    monkeypatch.setitem(sys.modules, "whisper_normalizer", None)
    monkeypatch.setitem(sys.modules, "whisper_normalizer.english", None)
    english_normalizer.cache_clear()
    yield
    english_normalizer.cache_clear()


def _jiwer_cer_as_given(jiwer, refs: list[str], hyps: list[str]) -> float:
    """jiwer's CER on the characters as given (its default strips each string's ends first)."""
    chars = jiwer.ReduceToListOfListOfChars()
    return jiwer.cer(refs, hyps, reference_transform=chars, hypothesis_transform=chars)


def test_raw_and_normalised_rates_equal_jiwers_pair_by_pair_and_pooled(normalize) -> None:
    jiwer = pytest.importorskip("jiwer")
    refs, hyps = [r for r, _ in PAIRS], [h for _, h in PAIRS]
    nrefs, nhyps = [normalize(r) for r in refs], [normalize(h) for h in hyps]
    scores = UtteranceScores(normalize)
    scores.add(refs, hyps)
    # exact: the same integer counts divided the same way
    for (ref, hyp), nref, nhyp in zip(PAIRS, nrefs, nhyps, strict=True):
        assert wer([ref], [hyp]) == jiwer.wer(ref, hyp), (ref, hyp)
        assert cer([ref], [hyp]) == jiwer.cer(ref, hyp), (ref, hyp)
        assert wer([nref], [nhyp]) == jiwer.wer(nref, nhyp), (nref, nhyp)
        assert cer([nref], [nhyp]) == jiwer.cer(nref, nhyp), (nref, nhyp)
    assert scores.rates() == {
        "wer": jiwer.wer(refs, hyps),
        "cer": jiwer.cer(refs, hyps),
        "wer_normalized": jiwer.wer(nrefs, nhyps),
        "cer_normalized": jiwer.cer(nrefs, nhyps),
    }
    # what the normaliser is for: numbers, spellings, punctuation, casing and fillers no longer count
    for row in scores.rows[2:9]:
        assert row["reference_normalized"] == row["hypothesis_normalized"], row
    assert scores.rates()["wer_normalized"] < scores.rates()["wer"]


def test_corpus_rates_pool_errors_over_words_as_jiwer_does_not_a_mean_of_rates() -> None:
    jiwer = pytest.importorskip("jiwer")
    refs, hyps = ["a b c d", "x", "go left now"], ["a b c d", "y", "go"]
    scores = UtteranceScores(None)
    scores.add(refs, hyps)
    totals = scores.totals()
    assert totals == {"word_errors": 3, "words": 8, "char_errors": 10, "chars": 19}
    assert scores.rates()["wer"] == 3 / 8 == wer(refs, hyps) == jiwer.wer(refs, hyps)
    assert scores.rates()["cer"] == 10 / 19 == cer(refs, hyps) == jiwer.cer(refs, hyps)
    mean_of_rates = sum(jiwer.wer(r, h) for r, h in zip(refs, hyps, strict=True)) / len(refs)
    assert abs(mean_of_rates - 3 / 8) > 0.1  # (0 + 1 + 2/3) / 3: a different number
    # each row's counts are the utterance's; their sums are the totals the rates divide
    assert [r["word_errors"] for r in scores.rows] == [0, 1, 2]
    assert {k: sum(r[k] for r in scores.rows) for k in COUNTS} == totals


def test_cer_counts_whitespace_at_the_ends_as_given(normalize) -> None:
    # a CTC hypothesis's stray spaces are symbols the model emitted: the raw CER counts them (jiwer's
    # default strips the ends first); the normaliser collapses spaces, so there both agree
    jiwer = pytest.importorskip("jiwer")
    ref, hyp = SPACED
    assert cer([ref], [hyp]) == _jiwer_cer_as_given(jiwer, [ref], [hyp]) == 5 / 15
    assert cer([ref], [hyp]) > jiwer.cer(ref, hyp)
    scores = UtteranceScores(normalize)
    scores.add([ref], [hyp])
    assert scores.rates()["cer_normalized"] == jiwer.cer(normalize(ref), normalize(hyp)) == 0.0
    all_refs, all_hyps = [*(r for r, _ in PAIRS), ref], [*(h for _, h in PAIRS), hyp]
    assert cer(all_refs, all_hyps) == _jiwer_cer_as_given(jiwer, all_refs, all_hyps)


def test_normaliser_equals_transformers_whisper_normaliser(normalize) -> None:
    # transformers ships Whisper's code but not its spelling table (a Hub file): given whisper-normalizer's
    # copy of that table, the two implementations must agree sentence by sentence
    english = pytest.importorskip("transformers.models.whisper.english_normalizer")
    table = json.loads(files("whisper_normalizer").joinpath("normalizers/english.json").read_text())
    reference = english.EnglishTextNormalizer(table)
    texts = [*SENTENCES, *(t for pair in PAIRS for t in pair), *SPACED]
    assert [normalize(t) for t in texts] == [reference(t) for t in texts]
    assert normalize(SENTENCES[1]).startswith("the color gray organize the theater is catalog")


def test_unchanged_text_keeps_its_raw_counts(normalize) -> None:
    scores = UtteranceScores(normalize)
    scores.add(["go left now", "the colour"], ["go left", "the color"])
    plain, british = scores.rows
    assert plain["reference_normalized"] == "go left now"  # already plain: the raw counts reused
    assert {k: plain[k + NORMALIZED] for k in COUNTS} == {k: plain[k] for k in COUNTS}
    assert (british["word_errors"], british["word_errors" + NORMALIZED]) == (1, 0)


def test_without_whisper_normalizer_the_normalised_rates_are_skipped_with_one_warning(
    without_whisper_normalizer: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="audio.scoring"):
        assert english_normalizer() is None and english_normalizer() is None
        scores = UtteranceScores(english_normalizer())
        scores.add(["the colour"], ["the color"])
    assert scores.rates() == {"wer": 0.5, "cer": 0.1}
    assert set(scores.rows[0]) == {"reference", "hypothesis", *COUNTS}
    warnings = [r for r in caplog.records if r.name == "audio.scoring"]
    assert len(warnings) == 1 and "torchkiln[speech]" in warnings[0].getMessage()


def test_the_asr_evaluation_without_whisper_normalizer_reports_the_raw_rates_and_warns_once(
    without_whisper_normalizer: None, caplog: pytest.LogCaptureFixture
) -> None:
    tok = CharTokenizer()
    refs = ["the colour", "go left"]
    targets = [torch.tensor(tok.encode(t)) for t in refs]
    batch = {
        "targets": torch.nn.utils.rnn.pad_sequence(targets, batch_first=True),
        "target_lengths": torch.tensor([len(t) for t in targets]),
    }
    results = []
    with caplog.at_level(logging.WARNING, logger="audio.scoring"):
        for _ in range(2):  # two validations, one warning
            scores = Scores(greedy_too=False)
            scores.add(batch, ["the color", "go left"], None, None, tok, torch.tensor(1.5), {})
            results.append(scores.result())
    assert results[0] == results[1] == {"loss": 1.5, "wer": 1 / 4, "cer": 1 / 17}
    assert len([r for r in caplog.records if r.name == "audio.scoring"]) == 1
