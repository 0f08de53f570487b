"""text.lm / text.classification tasks: settings fail at construction; data is read only when first needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import default_collate

from core.errors import ConfigError
from tests.core.accumulation_reference import (
    accumulated_grads,
    max_deviation,
    mean_of_means_grads,
    one_batch_grads,
)
from tests.helpers import fault
from text.classification import TextClassification
from text.lm import LanguageModeling

GPT = {"name": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32}


def test_lm_reads_its_corpus_on_first_use_not_at_construction(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-folder"
    task = LanguageModeling(model=GPT, data={"name": "text_files", "root": str(missing)}, context=16)
    assert "corpus" not in vars(task) and "tokenizer" not in vars(task)  # nothing read or fitted yet
    with pytest.raises(ConfigError) as e:  # the data section's declared bounds: an existing folder
        task.build_datasets()
    assert fault(e.value)[:2] == ("data.root", str(missing))
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
    with pytest.raises(ConfigError) as e:
        task(model=GPT, data={"name": "kjv"}, tokenizer="words")
    assert fault(e.value) == ("tokenizer", "words", ("bytes", "bpe", "pretrained", "torchtext"))
    with pytest.raises(ConfigError) as e:
        task(model=GPT, data={"name": "nope"})
    assert fault(e.value)[:2] == ("data", "nope") and "kjv" in fault(e.value)[2]


def test_lm_micro_batches_of_packed_chunks_accumulate_to_one_batch_of_them(tmp_path: Path) -> None:
    # packed chunks of documents of many lengths: IGNOREd targets where a chunk crosses into the next
    # document, so chunks hold unequal counts of the tokens the loss averages over
    (tmp_path / "docs").mkdir()
    for i in range(12):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text("the quick brown fox. " * (1 + i % 5))
    docs = {"name": "text_files", "root": str(tmp_path / "docs")}
    task = LanguageModeling(model={**GPT, "dropout": 0.0}, data=docs, context=16)
    train, _ = task.build_datasets()
    torch.manual_seed(0)
    model = task.build_model().double()
    items = [train[i] for i in range(5)]
    micro = [default_collate(items[:2]), default_collate(items[2:])]
    units = [task.loss_units(b) for b in micro]
    assert units[0] / 2 != units[1] / 3  # unequal tokens per chunk: the mean of means would be off

    def ready(m: torch.nn.Module, b: Any) -> Any:
        return b

    # a share whose targets are all ignored weighs nothing: a zero loss, not an empty mean's NaN
    x, y, d = micro[0]
    assert task.step(model, (x, y.fill_(-100), d)).loss.item() == 0.0
    micro[0] = default_collate(items[:2])

    want = one_batch_grads(task, model, default_collate(items), ready)
    got = accumulated_grads(task, model, micro, ready)
    assert max_deviation(got, want) < 1e-10  # float64, summation order
    assert max_deviation(mean_of_means_grads(task, model, micro, ready), want) > 1e-6
