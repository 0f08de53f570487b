"""Interpolated Kneser-Ney n-grams: hand-computed probabilities, normalisation, the ARPA round trip."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from audio.ngram import BOS, EOS, UNK, NGramLM, kneser_ney, ney_discount, read_sentences
from core.errors import DataError
from tests.helpers import fault


def _bigram() -> NGramLM:
    # "<s> a b </s>", "<s> a </s>"; D = 0.5 at both orders. Continuation counts: a 1, b 1, </s> 2 (sum 4, 3
    # types, gamma() = 0.5 x 3 / 4 = 0.375), uniform 1/4 over {a, b, </s>, <unk>}.
    return kneser_ney([["a", "b"], ["a"]], order=2, discounts=[0.5, 0.5])


def test_kneser_ney_bigram_matches_hand_computed_probabilities() -> None:
    lm = _bigram()
    p = lambda w, *h: 10 ** lm.log10_prob(w, h)  # noqa: E731
    u = 0.375 * 0.25  # the uniform share of every unigram
    hand = {
        ("a",): 0.5 / 4 + u,
        ("b",): 0.5 / 4 + u,
        (EOS,): 1.5 / 4 + u,
        (UNK,): u,
        # after <s>: raw count 2 of 2 tokens, 1 type -> gamma 0.25
        ("a", BOS): 1.5 / 2 + 0.25 * (0.5 / 4 + u),
        ("b", BOS): 0.25 * (0.5 / 4 + u),  # unseen: backed off
        # after a: b 1, </s> 1 -> gamma 0.5
        ("b", "a"): 0.5 / 2 + 0.5 * (0.5 / 4 + u),
        (EOS, "a"): 0.5 / 2 + 0.5 * (1.5 / 4 + u),
        # after b: </s> 1 -> gamma 0.5; "zebra" is <unk>
        (EOS, "b"): 0.5 + 0.5 * (1.5 / 4 + u),
        ("zebra", "b"): 0.5 * u,
        ("a", "b"): 0.5 * (0.5 / 4 + u),
    }
    for (w, *h), want in hand.items():
        assert p(w, *h) == pytest.approx(want, rel=1e-12), (w, h)
    assert 10 ** lm.log10_prob(BOS) == pytest.approx(1e-99)  # <s> is never predicted
    want = (1.5 / 2 + 0.25 * (0.5 / 4 + u)) * (0.5 / 2 + 0.5 * (0.5 / 4 + u)) * (0.5 + 0.5 * (1.5 / 4 + u))
    assert 10 ** lm.sentence_log10_prob(["a", "b"]) == pytest.approx(want, rel=1e-12)


def test_kneser_ney_trigram_middle_order_uses_continuation_counts() -> None:
    # "<s> x a </s>", "<s> y a </s>", "<s> x b </s>": as a bigram context-free estimate, a follows two
    # distinct words (x, y) and b one; at order 3 the bigram "x a" has continuation count 1 (only <s>
    # before it), "<s> x" keeps its raw count 2
    lm = kneser_ney([["x", "a"], ["y", "a"], ["x", "b"]], order=3, discounts=[0.5, 0.5, 0.5])
    # unigram continuation counts: x 1, y 1, a 2, b 1, </s> 2 (sum 7, 5 types); V = 6 with <unk>
    u = 0.5 * 5 / 7 / 6
    p1 = {"a": 1.5 / 7 + u, "b": 0.5 / 7 + u, EOS: 1.5 / 7 + u}
    # bigram context x (adjusted: "x a" 1, "x b" 1; sum 2, 2 types -> gamma 0.5)
    p2_a_x = 0.5 / 2 + 0.5 * p1["a"]
    # trigram context (<s>, x): raw "<s> x a" 1, "<s> x b" 1 -> gamma 0.5
    want = 0.5 / 2 + 0.5 * p2_a_x
    assert 10 ** lm.log10_prob("a", [BOS, "x"]) == pytest.approx(want, rel=1e-12)
    # an unseen trigram backs off through the bigram context's gamma: p(b | <s> y) = 0.5 x p2(b | y)
    p2_b_y = 0.5 * p1["b"]  # y's only follower is a: gamma(y) = 0.5 x 1 / 1
    assert 10 ** lm.log10_prob("b", [BOS, "y"]) == pytest.approx(0.5 * p2_b_y, rel=1e-12)


def test_every_context_sums_to_one() -> None:
    sentences = [s.split() for s in ("the cat sat", "the cat ran", "a dog sat", "the dog", "a cat sat down")]
    lm = kneser_ney(sentences, order=3)  # Ney's discounts
    outcomes = sorted(lm.vocab - {BOS})
    words = sorted(lm.vocab - {EOS, UNK})
    for n in range(3):
        for ctx in itertools.product(words, repeat=n):
            total = sum(10 ** lm.log10_prob(w, ctx) for w in outcomes)
            assert total == pytest.approx(1.0, abs=1e-9), ctx


def test_ney_discount() -> None:
    assert ney_discount([1, 1, 1, 2, 5]) == pytest.approx(3 / (3 + 2 * 1))
    assert ney_discount([3, 4]) == 0.5  # no ones or twos: the fallback


def test_arpa_round_trip_keeps_probabilities(tmp_path: Path) -> None:
    lm = kneser_ney([s.split() for s in ("the cat sat", "the cat ran", "a dog sat")], order=3)
    lm.save(tmp_path / "lm.arpa")
    text = (tmp_path / "lm.arpa").read_text()
    assert "\\data\\" in text and "ngram 3=" in text and text.rstrip().endswith("\\end\\")
    back = NGramLM.from_arpa(tmp_path / "lm.arpa")
    assert back.order == 3 and back.words == ["a", "cat", "dog", "ran", "sat", "the"]
    for ctx in ([], [BOS], [BOS, "the"], ["the", "cat"], ["dog", "the"], ["cat", "zebra"]):
        for w in ("cat", "sat", EOS, "zebra"):
            # 7 significant digits in the file
            assert back.log10_prob(w, ctx) == pytest.approx(lm.log10_prob(w, ctx), rel=1e-6, abs=1e-6)


def test_bad_arpa_and_missing_corpus_are_one_line_data_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.arpa"
    bad.write_text("\\data\\\nngram 1=1\n\n\\1-grams:\nnot-a-number word\n\\end\\\n")
    with pytest.raises(DataError) as e:
        NGramLM.from_arpa(bad)
    assert fault(e.value) == ("task.lm", str(bad), ("an ARPA file",))
    with pytest.raises(DataError) as e:
        read_sentences(tmp_path / "missing.txt")
    assert fault(e.value)[:2] == ("task.lm_text", str(tmp_path / "missing.txt"))
    (tmp_path / "corpus.txt").write_text("Hello, World!\n\nthe 2 cats\n")
    assert read_sentences(tmp_path / "corpus.txt") == [["hello", "world"], ["the", "two", "cats"]]
    assert math.isfinite(kneser_ney(read_sentences(tmp_path / "corpus.txt")).log10_prob("cats", ["two"]))


def test_kenlm_reads_the_arpa_file_and_scores_sentences_alike(tmp_path: Path) -> None:
    # KenLM (the reference ARPA reader; optional, LGPL) queries the file this module writes
    kenlm = pytest.importorskip("kenlm")
    lm = kneser_ney([s.split() for s in ("the cat sat", "the cat ran", "a dog sat", "a cat")], order=3)
    lm.save(tmp_path / "lm.arpa")
    ref = kenlm.Model(str(tmp_path / "lm.arpa"))
    for sentence in ("the cat sat", "a cat ran", "sat the zebra", "the"):
        # KenLM computes in float32
        assert ref.score(sentence, bos=True, eos=True) == pytest.approx(
            lm.sentence_log10_prob(sentence.split()), abs=1e-5
        )


def test_the_n_gram_module_imports_no_torch_and_nothing_that_imports_it_back() -> None:
    import ast
    from pathlib import Path

    def imported(module: str) -> set[str]:
        tree = ast.parse(Path(module.replace(".", "/") + ".py").read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        return names | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    own = imported("audio.ngram")
    assert not any(m.split(".")[0] == "torch" or m == "audio.ctc" for m in own), own
    assert not any(m.split(".")[0] == "torch" for m in imported("audio.transcripts"))
