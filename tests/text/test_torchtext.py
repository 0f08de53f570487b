"""The torchtext tokenizer path; runs on the legacy stack only (`make test-legacy`)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import TINY_CLS, TINY_LM, write_table
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
    assert tok.decode([tok.eos_id, *tok.encode("light"), tok.eos_id, tok.pad_id]) == "light"


def test_lm_recipe_with_torchtext(cli: Callable, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = cli("+task=lm", "tokenizer=torchtext", "trainer=smoke", "trainer.max_steps=2", "trainer.batch_size=4",
            *TINY_LM, "hydra.run.dir=run")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "result.json").read_text())["metrics"]
    assert math.isfinite(metrics["val/loss"])

    from recipes.generate import main

    assert main([f"ckpt={tmp_path / 'run'}", "prompt=And God said,", "max_new_tokens=5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("and god said , ") and len(out.split()) > 4  # the normalised prompt, then words


def test_classification_recipe_with_torchtext(cli: Callable, tmp_path: Path) -> None:
    write_table(tmp_path / "train.jsonl", 40)
    write_table(tmp_path / "val.jsonl", 5)
    data = ["data=text_table", "data.train=train.jsonl", "data.val=val.jsonl"]
    loop = ["trainer=smoke", "trainer.max_steps=30", "trainer.max_epochs=10", "trainer.batch_size=8"]
    r = cli("+task=text_classification", "tokenizer=torchtext", *loop, "optim.lr=1e-2", *data, *TINY_CLS,
            "hydra.run.dir=run")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "result.json").read_text())["metrics"]
    assert metrics["val/accuracy"] == 1.0  # disjoint vocabularies: 30 steps separate them
