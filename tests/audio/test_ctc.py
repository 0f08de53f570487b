"""CTC tokenizer, greedy/beam decoding and WER/CER against hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from audio.ctc import (
    BeamSearchDecoder,
    CharTokenizer,
    Lexicon,
    SubwordTokenizer,
    beam_search_available,
    cer,
    edit_counts,
    greedy_decode,
    normalize_transcript,
    require_lm_decoding,
    wer,
)
from audio.ngram import kneser_ney
from core.errors import ConfigError
from tests.helpers import fault


def test_normalize_spells_digits_and_drops_punctuation() -> None:
    assert normalize_transcript("Hello, World 42!") == "hello world four two"
    assert normalize_transcript("  DON'T   stop-now ") == "don't stop now"


def test_tokenizer_round_trip_and_blank() -> None:
    tok = CharTokenizer()
    assert len(tok) == 29 and tok.blank == 0 and tok.symbols[0] == "<blank>"
    ids = tok.encode("Go left")
    assert 0 not in ids and tok.decode(ids) == "go left"


def test_wer_cer_hand_computed() -> None:
    # "cat"->"bat" is 1 substitution, "down" 1 insertion: 2 word errors over 3 reference words
    assert wer(["the cat sat"], ["the bat sat down"]) == pytest.approx(2 / 3)
    # characters: c->b (1) plus " down" inserted (5): 6 edits over 11 reference characters
    assert cer(["the cat sat"], ["the bat sat down"]) == pytest.approx(6 / 11)
    # pooled over utterances, not averaged: (1 deletion + 0) / (2 + 1) words
    assert wer(["go left", "stop"], ["go", "stop"]) == pytest.approx(1 / 3)
    assert edit_counts(["a b"], [""]) == {"word_errors": 2, "words": 2, "char_errors": 3, "chars": 3}
    assert wer(["yes"], ["yes"]) == 0.0


def _peaked(paths: list[list[int]], vocab: int = 29) -> torch.Tensor:
    """Log-probabilities that put almost all mass on the given per-frame ids."""
    t = max(len(p) for p in paths)
    lp = torch.full((len(paths), t, vocab), -20.0)
    for b, p in enumerate(paths):
        for i, c in enumerate(p):
            lp[b, i, c] = 0.0
    return lp.log_softmax(-1)


def test_greedy_decode_merges_repeats_drops_blanks_and_respects_lengths() -> None:
    tok = CharTokenizer()
    a, b, sp = tok.encode("a")[0], tok.encode("b")[0], tok.encode("a b")[1]
    paths = [[a, a, 0, a, b, b, 0, sp, b], [b, 0, 0, a, a, a, a, a, b]]
    out = greedy_decode(_peaked(paths), torch.tensor([9, 5]))
    assert [tok.decode(x) for x in out] == ["aab b", "ba"]  # the second is cut at 5 frames


def test_beam_search_matches_greedy_on_peaked_scores() -> None:
    tok = CharTokenizer()
    ids = tok.encode("go up")
    path = [x for c in ids for x in (c, 0)]
    assert beam_search_available()  # flashlight-text is in the dev and speech extras
    assert BeamSearchDecoder(tok, 8)(_peaked([path]), torch.tensor([len(path)])) == ["go up"]


def test_beam_search_without_flashlight_is_a_one_line_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("audio.ctc.beam_search_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        BeamSearchDecoder(CharTokenizer(), 4)
    assert fault(e.value) == ("task.decoder", "beam/beam_lexicon", ("flashlight-text installed", "greedy"))


def _soft(frames: list[dict[str, float]]) -> torch.Tensor:
    """(1, T, V) log-probabilities from per-frame {symbol: probability} ('-' = blank), rest spread thin."""
    tok = CharTokenizer()
    p = torch.full((1, len(frames), len(tok)), 1e-4)
    for t, f in enumerate(frames):
        for sym, prob in f.items():
            p[0, t, 0 if sym == "-" else tok.symbols.index(sym)] = prob
    return (p / p.sum(-1, keepdim=True)).log()


def test_lexicon_beam_search_splits_merged_words_that_snapping_cannot() -> None:
    tok = CharTokenizer()
    # the word boundary loses to a blank on its frame: the best path reads "goup"
    boundary = {"-": 0.55, " ": 0.4}
    lp = _soft([{"g": 0.9}, {"-": 0.9}, {"o": 0.9}, boundary, {"u": 0.9}, {"-": 0.9}, {"p": 0.9}])
    lengths = torch.tensor([7])
    assert tok.decode(greedy_decode(lp, lengths)[0]) == "goup"
    words = ["go", "up", "stop", "left"]
    assert Lexicon(words).correct("goup") == "go"  # snapping keeps one word: 1 deletion of 2
    assert BeamSearchDecoder(tok, 8, words)(lp, lengths) == ["go up"]
    # lexicon-free beam search keeps the merged word; a constrained one never emits an unknown word
    assert BeamSearchDecoder(tok, 8)(lp, lengths) == ["goup"]
    assert BeamSearchDecoder(tok, 8, ["stop", "left"])(lp, lengths)[0].split() <= ["stop", "left"] * 3


def test_lexicon_snaps_unknown_words_to_the_nearest_known_one() -> None:
    lex = Lexicon(["kitchen", "to", "two", "morning", "marvin"])
    assert len(lex) == 5
    # "kaichen" is 1 substitution from "kitchen"; known words stay even when a homophone was meant
    assert lex.correct("kaichen to marving") == "kitchen to marvin"
    assert lex.nearest("morni") == "morning"  # 2 deletions, versus 3 edits to "marvin"
    assert lex.correct("") == ""


CORPUS = ["the cat sat", "the cat ran", "a hat fit", "a hat sat", "the dog sat"]


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_subword_tokenizer_round_trips_and_saves_as_json(kind: str) -> None:
    tok = SubwordTokenizer.train(CORPUS * 5, kind, 60)
    assert tok.blank == 0 and tok.symbols[:2] == ["<blank>", "<unk>"] and len(tok) <= 60
    for text in ("the cat sat", "Zebras don't QUIT!"):  # unseen letters and words still spell out
        ids = tok.encode(text)
        assert 0 not in ids and 1 not in ids and tok.decode(ids) == normalize_transcript(text)
    assert len(tok.encode("the cat sat")) < len("the cat sat")  # learned pieces, not letters
    back = SubwordTokenizer.from_json(tok.to_json())
    assert back.symbols == tok.symbols and back.encode("a hat ran") == tok.encode("a hat ran")
    with pytest.raises(ConfigError) as e:
        SubwordTokenizer.train(CORPUS, kind, 20)
    assert fault(e.value) == ("task.vocab_size", "20", (">= 30",))


def _soft_tokens(frames: list[dict[str, float]], symbols: list[str], blank: str) -> torch.Tensor:
    """(1, T, V) log-probabilities from per-frame {token: probability}, the blank after every frame."""
    p = torch.full((1, 2 * len(frames), len(symbols)), 1e-4)
    for t, f in enumerate(frames):
        for sym, prob in f.items():
            p[0, 2 * t, symbols.index(sym)] = prob
        p[0, 2 * t + 1, symbols.index(blank)] = 0.9
    return (p / p.sum(-1, keepdim=True)).log()


def test_lm_beam_search_fixes_a_word_greedy_and_the_lexicon_get_wrong() -> None:
    # "h" narrowly beats "c" acoustically; both "cat" and "hat" are words, but only "the cat" is in the LM
    # corpus ("a hat"), so the n-gram is what picks "the cat sat"
    lm = kneser_ney([s.split() for s in CORPUS], order=3)
    tok = CharTokenizer()
    frames = [{c: 0.9} for c in "the "] + [{"h": 0.5, "c": 0.4}] + [{c: 0.9} for c in "at sat"]
    lp = _soft_tokens(frames, tok.symbols, "<blank>")
    lengths = torch.tensor([lp.shape[1]])
    assert tok.decode(greedy_decode(lp, lengths)[0]) == "the hat sat"
    assert BeamSearchDecoder(tok, 8)(lp, lengths) == ["the hat sat"]
    assert BeamSearchDecoder(tok, 8, lm.words)(lp, lengths) == ["the hat sat"]
    assert BeamSearchDecoder(tok, 8, lm=lm, lm_weight=0.0)(lp, lengths) == ["the hat sat"]  # LM off
    assert BeamSearchDecoder(tok, 8, lm=lm, lm_weight=1.0)(lp, lengths) == ["the cat sat"]
    # subwords: "▁cat" and "▁hat" are one piece each in a vocabulary learned from the corpus
    sub = SubwordTokenizer.train(CORPUS * 5, "bpe", 60)
    assert [sub.spell(w) for w in ("the", "cat", "hat", "sat")] == [["▁the"], ["▁cat"], ["▁hat"], ["▁sat"]]
    lp = _soft_tokens([{"▁the": 0.9}, {"▁hat": 0.5, "▁cat": 0.4}, {"▁sat": 0.9}], sub.symbols, "<blank>")
    lengths = torch.tensor([lp.shape[1]])
    assert sub.decode(greedy_decode(lp, lengths)[0]) == "the hat sat"
    assert BeamSearchDecoder(sub, 8)(lp, lengths) == ["the hat sat"]
    assert BeamSearchDecoder(sub, 8, lm.words)(lp, lengths) == ["the hat sat"]
    assert BeamSearchDecoder(sub, 8, lm=lm, lm_weight=1.0)(lp, lengths) == ["the cat sat"]


def test_lm_decoding_without_flashlight_is_a_one_line_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("audio.ctc.beam_search_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        require_lm_decoding()
    assert fault(e.value) == ("task.decoder", "beam_lm", ("flashlight-text installed",))
