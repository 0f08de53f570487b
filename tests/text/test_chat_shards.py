"""Chat conversations from token shards (`recipes.prepare +task=sft`, `+task=sft data=tokens`): the rows read
from the shards are the in-memory task's rows exactly (tokens, targets, document ids), for bytes, bpe and a
Hugging Face folder's tokenizer and template; a run trains and evaluates from them; a folder prepared for the
lm task, or with another tokenizer or template, is one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.errors import ConfigError, DataError
from recipes.prepare import main as prepare_main
from tests.helpers import fault, read_metrics, train
from text.sft import ChatFineTuning

MODEL = {"name": "llama", "n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "hidden": 64}


def chats(path: Path, n: int = 60) -> Path:
    """`n` conversations of very different lengths, some with a system turn and two exchanges."""
    rows = []
    for i in range(n):
        conv = [{"role": "user", "content": f"Say {i} " + "please " * (i % 7)}]
        conv.append({"role": "assistant", "content": "word " * (1 + 5 * (i % 4))})
        if i % 3 == 0:
            conv = [{"role": "system", "content": "Be brief."}, *conv, {"role": "user", "content": "Again"}]
            conv.append({"role": "assistant", "content": f"{i}"})
        rows.append(json.dumps({"messages": conv}) + "\n")
    path.write_text("".join(rows))
    return path


def prepared(out: Path, *args: str) -> Path:
    code = prepare_main(["+task=sft", f"out={out}", "shard_tokens=512", "progress=false", *args])
    assert code == 0
    return out


def same_rows(a: torch.utils.data.Dataset, b: torch.utils.data.Dataset) -> None:
    assert len(a) == len(b) > 3
    for i in range(len(a)):
        for x, y in zip(a[i], b[i], strict=True):
            assert torch.equal(x, y), i


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_rows_from_the_shards_are_the_in_memory_rows(tmp_path: Path, tokenizer: str) -> None:
    data = chats(tmp_path / "c.jsonl")
    out = prepared(
        tmp_path / "shards", f"data.train={data}", f"tokenizer={tokenizer}", "task.bpe_vocab_size=300"
    )
    m = json.loads((out / "manifest.json").read_text())
    assert len(m["splits"]["train"]["shards"]) > 3  # conversations cross shard boundaries
    common = {"model": MODEL, "tokenizer": tokenizer, "bpe_vocab_size": 300, "context": 96}
    memory = ChatFineTuning(data={"name": "chat", "train": str(data)}, **common)
    shards = ChatFineTuning(data={"name": "tokens", "path": str(out)}, **common)
    assert shards.tokenizer.vocab_size == memory.tokenizer.vocab_size
    for a, b in zip(shards.build_datasets(), memory.build_datasets(), strict=True):
        same_rows(a, b)
    assert shards.val_conversations == memory.corpus.val and shards.majority_answer == memory.majority_answer


def test_an_hf_folders_template_and_tokenizer_prepare_the_same_rows(tmp_path: Path) -> None:
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the `hf` extra) is not installed"
    )
    from tests.text.test_sft import QWEN
    from text.tokenizer import BPETokenizer

    data = chats(tmp_path / "c.jsonl")
    folder = tmp_path / "qwen"
    texts = [QWEN] + [
        m["content"] for line in data.read_text().splitlines() for m in json.loads(line)["messages"]
    ]
    tok = BPETokenizer.train(texts, 300, cache_dir=tmp_path / "bpe")
    config = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=tok.eos_id,
        tie_word_embeddings=True,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN, "eos_token": "<eos>"}))
    out = prepared(
        tmp_path / "shards", f"data.train={data}", "tokenizer=pretrained", f"model.weights={folder}"
    )
    common = {"model": {"name": "llama", "weights": str(folder)}, "tokenizer": "pretrained", "context": 128}
    memory = ChatFineTuning(data={"name": "chat", "train": str(data)}, **common)
    shards = ChatFineTuning(data={"name": "tokens", "path": str(out)}, **common)
    for a, b in zip(shards.build_datasets(), memory.build_datasets(), strict=True):
        same_rows(a, b)
    # the same folder prepared with ChatML (tokenizer=bytes) is refused by a run with the folder's template
    other = prepared(tmp_path / "chatml", f"data.train={data}")
    with pytest.raises(ConfigError) as e:
        _ = ChatFineTuning(data={"name": "tokens", "path": str(other)}, **common).tokenizer
    assert fault(e.value)[:2] == ("tokenizer", "pretrained")


@pytest.mark.slow  # a whole run (default suite time)
def test_a_run_trains_and_answers_from_the_shards(tmp_path: Path) -> None:
    out = prepared(tmp_path / "shards")  # the embedded KJV questions
    args = ["+task=sft", "data=tokens", f"data.path={out}", "trainer=smoke", "task.context=128"]
    args += ["task.eval_questions=4", "logger=none", "precision=fp32", "model.n_layer=1", "model.d_model=32"]
    args += ["model.n_head=2", "model.n_kv_head=1", "model.hidden=64", "trainer.batch_size=4"]
    run = train(tmp_path / "run", args)
    rows = [r for r in read_metrics(run) if "val/exact_match" in r]
    assert rows and rows[-1]["step"] == 5 and 0 < rows[-1]["val/majority_baseline"] < 1


def test_a_folder_prepared_for_the_lm_task_is_one_line_naming_data_path(tmp_path: Path) -> None:
    (tmp_path / "text").mkdir()
    for i in range(8):
        (tmp_path / "text" / f"{i}.txt").write_text(f"in the beginning {i} " * 200)
    code = prepare_main(
        [
            "+task=lm",
            f"data.root={tmp_path / 'text'}",
            f"out={tmp_path / 'lm'}",
            "progress=false",
            "data.val_fraction=0.5",
        ]
    )
    assert code == 0
    task = ChatFineTuning(model=MODEL, data={"name": "tokens", "path": str(tmp_path / "lm")}, context=64)
    with pytest.raises(DataError) as e:
        task.build_datasets()
    assert fault(e.value)[:2] == ("data.path", str(tmp_path / "lm"))
