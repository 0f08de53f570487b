"""text.lm / text.classification tasks: settings fail at construction; data is read only when first needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import ConfigError, DataError
from text.classification import TextClassification
from text.lm import LanguageModeling

GPT = {"name": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32}


def test_lm_reads_its_corpus_on_first_use_not_at_construction(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-folder"
    task = LanguageModeling(model=GPT, data={"name": "text_files", "root": str(missing)}, context=16)
    assert "corpus" not in vars(task) and "tokenizer" not in vars(task)  # nothing read or fitted yet
    with pytest.raises(DataError, match="no-such-folder"):
        task.build_datasets()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("In the beginning. " * 40)
    docs = {"name": "text_files", "root": str(tmp_path / "docs")}
    task = LanguageModeling(model=GPT, data=docs, context=16)
    train, val = task.build_datasets()
    assert (
        len(train) > 0 and len(val) > 0 and task.build_model().head.out_features == task.tokenizer.vocab_size
    )


@pytest.mark.parametrize("task", [LanguageModeling, TextClassification])
def test_bad_settings_fail_at_construction_with_one_line(task: type) -> None:
    with pytest.raises(ConfigError, match=r"^tokenizer=words is unknown; valid: bytes, bpe, torchtext$"):
        task(model=GPT, data={"name": "kjv"}, tokenizer="words")
    with pytest.raises(ConfigError, match=r"^unknown data 'nope'; valid choices: .*kjv"):
        task(model=GPT, data={"name": "nope"})
