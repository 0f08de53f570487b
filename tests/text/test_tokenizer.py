"""Tokenizers: exact round trips, cached BPE training, and the torchtext error on the current stack."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from core.errors import ConfigError
from tests.helpers import fault
from text.tokenizer import BPETokenizer, ByteTokenizer, build_tokenizer

SAMPLES = [
    "In the beginning God created the heaven and the earth.\n",
    "ünïcödé — 漢字 🙂",
    "  two  spaces\t",
    "",
]
CORPUS = [
    f"And the {w} said unto the {v}, Go thou and {w} the {v}.\n" for w in "lord king man" for v in "sea land"
]


def test_bytes_round_trip_and_ids() -> None:
    tok = ByteTokenizer()
    for s in SAMPLES:
        ids = tok.encode(s)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == s
    assert tok.decode([72, tok.pad_id, 105, tok.eos_id]) == "Hi"
    assert tok.vocab_size == 258


def test_bpe_round_trip_is_exact_on_unseen_text(tmp_path: Path) -> None:
    tok = build_tokenizer("bpe", CORPUS, bpe_vocab_size=300, cache_dir=tmp_path)
    assert tok.vocab_size <= 300 and {tok.pad_id, tok.eos_id} == {0, 1}
    for s in SAMPLES:
        assert tok.decode(tok.encode(s)) == s
    assert len(tok.encode(CORPUS[0])) < len(CORPUS[0].encode()) / 2  # merges were learned from the corpus
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]


def test_bpe_is_cached_by_corpus_and_size(tmp_path: Path) -> None:
    first = BPETokenizer.train(CORPUS, 300, tmp_path)
    assert len(list(tmp_path.glob("bpe-300-*.json"))) == 1
    again = BPETokenizer.train(CORPUS, 300, tmp_path)
    assert again.encode(CORPUS[1]) == first.encode(CORPUS[1])
    BPETokenizer.train(CORPUS[:3], 300, tmp_path)
    assert len(list(tmp_path.glob("bpe-300-*.json"))) == 2  # another corpus, another cache entry
    with pytest.raises(ConfigError) as e:
        BPETokenizer.train(CORPUS, 100, tmp_path)
    assert fault(e.value) == ("task.bpe_vocab_size", "100", (">= 258",))


def test_torchtext_unavailable_is_one_line_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchtext", None)  # import fails as on the current stack
    with pytest.raises(ConfigError) as e:
        build_tokenizer("torchtext", CORPUS)
    msg = str(e.value)
    assert "\n" not in msg
    assert "torchtext 0.18" in msg and "torch 2.3" in msg and "make test-legacy" in msg


def test_unknown_tokenizer_lists_choices() -> None:
    with pytest.raises(ConfigError) as e:
        build_tokenizer("chars", CORPUS)
    assert fault(e.value) == ("tokenizer", "chars", ("bytes", "bpe", "pretrained", "torchtext"))
