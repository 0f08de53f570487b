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


def _write_texts(root: Path, words: tuple[str, ...]) -> Path:
    """Two text files (documents) of verses made of `words`, as a user's data=text_files folder."""
    root.mkdir(parents=True)
    for i in range(2):
        lines = [f"And the {w} said unto the {v}, Go thou. {i}" for w in words for v in words[::-1]] * 20
        (root / f"{i}.txt").write_text("\n".join(lines) + "\n")
    return root


def test_a_bpe_run_keeps_its_vocabulary_for_eval_on_other_text_and_generates_without_its_data(
    tmp_path: Path,
) -> None:
    import shutil

    from recipes.cli.runs import load_run
    from tests.helpers import run_here, train
    from text.prepare import TokenizerChoice, prepare
    from text.tokenizer import tokenizer_hash

    root = _write_texts(tmp_path / "text", ("lord", "king", "sea", "land"))
    args = [
        "+task=lm",
        "model=gpt",
        "model.n_layer=1",
        "model.d_model=32",
        "model.n_head=2",
        "task.context=32",
    ]
    args += ["data=text_files", f"data.root={root}", "tokenizer=bpe", "task.bpe_vocab_size=300"]
    run = train(tmp_path / "run", [*args, "trainer=smoke", "trainer.max_steps=2", "logger=none"])
    assert (run / "tokenizer.json").is_file()
    trained = load_run(run, device="cpu").task.tokenizer
    # eval on another folder: the run's ids, where fitting the tokenizer again on that text gives others
    other = _write_texts(tmp_path / "other", ("shepherd", "valley", "cup", "table"))
    overrides = ["data.name=text_files", f"data.root={other}"]
    on_other = load_run(run, device="cpu", overrides=overrides).task.tokenizer
    assert tokenizer_hash(on_other) == tokenizer_hash(trained)
    refit = BPETokenizer.train([p.read_text() for p in sorted(other.iterdir())], 300, cache_dir=tmp_path)
    assert tokenizer_hash(refit) != tokenizer_hash(trained)
    # shards prepared with another vocabulary are refused, naming the key, not read with the wrong ids
    shards = tmp_path / "shards"
    prepare(str(other), str(shards), tokenizer=TokenizerChoice("bpe", 300), val_fraction=0.5, progress=False)
    with pytest.raises(ConfigError) as err:
        load_run(run, device="cpu", overrides=["data.name=tokens", f"data.path={shards}"])
    assert fault(err.value)[:2] == ("tokenizer", "bpe")
    # generate needs the run directory alone: the same text with the training folder gone
    before = run_here(
        "recipes.generate", f"ckpt={run}", "prompt=And the", "temperature=0", "max_new_tokens=8"
    )
    shutil.rmtree(root)
    after = run_here("recipes.generate", f"ckpt={run}", "prompt=And the", "temperature=0", "max_new_tokens=8")
    assert before.returncode == after.returncode == 0, after.stderr
    assert after.stdout == before.stdout and after.stdout.startswith("And the")
