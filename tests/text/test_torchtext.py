"""The torchtext tokenizer path; runs on the legacy stack only (`make test-legacy`)."""

from __future__ import annotations

import pytest

from text.tokenizer import build_tokenizer

pytestmark = pytest.mark.legacy

CORPUS = ["In the beginning God created the heaven and the earth.\n", "And God said, Let there be light.\n"]


def test_torchtext_round_trip_is_the_normalised_text() -> None:
    tok = build_tokenizer("torchtext", CORPUS)  # first: it silences torchtext's end-of-life warning
    from torchtext.data.utils import get_tokenizer

    split = get_tokenizer("basic_english")
    for text in CORPUS:
        assert tok.decode(tok.encode(text)) == " ".join(split(text))
    assert tok.decode(tok.encode("And GOD said, light!")) == "and god said , light <unk>"


def test_torchtext_vocabulary_has_the_specials_first() -> None:
    tok = build_tokenizer("torchtext", CORPUS)
    assert (tok.pad_id, tok.eos_id) == (0, 1)
    assert tok.vocab.lookup_token(2) == "<unk>"
    words = {w for t in CORPUS for w in t.lower().replace(",", " , ").replace(".", " . ").split()}
    assert tok.vocab_size == 3 + len(words)
    assert tok.encode_batch(CORPUS) == [tok.encode(t) for t in CORPUS]
    assert tok.decode([tok.encode("light")[0], tok.eos_id, tok.pad_id]) == "light \n"
