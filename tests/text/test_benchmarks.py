"""The embedded KJV benchmarks (`text.benchmarks`): the generated lm-eval task folder is the same bytes on
every call and from processes started together, loads offline through lm-eval's own TaskManager, asks
four-way questions whose gold is among the choices, about verses that neither the `kjv` LM corpus nor the
`chat` questions train on; and lm-eval's HFLM scores a tiny random Llama on the `kjv` group end to end."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.errors import ConfigError
from tests.helpers import fault
from text.benchmarks import TASKS, baseline, task_folder
from text.chat import chat
from text.corpus import in_validation, kjv_verses
from text.lm_data import kjv

MC_TASKS = ("kjv_next_words", "kjv_book_mc", "kjv_cloze")
#: the default split of the `kjv`, `chat` and `kjv_groups` datasets
VAL_FRACTION = 0.1


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One generated folder for the module's read-only checks."""
    return task_folder(tmp_path_factory.mktemp("benchmarks"))


def rows(folder: Path, task: str) -> list[dict[str, Any]]:
    """The JSONL rows of `task` in `folder`."""
    return [json.loads(line) for line in (folder / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()]


def contents(folder: Path) -> dict[str, bytes]:
    """Every file `task_folder` wrote (not lm-eval's dataset cache, nor the lock), by name."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.suffix != ".lock"}


def test_a_second_call_finds_the_folder_and_rewrites_nothing(folder: Path) -> None:
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()}
    assert task_folder(folder.parent) == folder
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()} == before
    assert {f"{t}.{ext}" for t in TASKS for ext in ("yaml", "jsonl")} | {"_kjv.yaml"} <= set(before)


def test_processes_started_together_write_the_same_bytes(folder: Path, tmp_path: Path) -> None:
    code = "import sys; from pathlib import Path; from text.benchmarks import task_folder; "
    code += "print(task_folder(Path(sys.argv[1])))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1]
    theirs = Path(outs[0])
    assert theirs.parent == tmp_path and theirs.name == folder.name  # the fingerprint does not name the root
    # the YAMLs name their data by absolute path; everything else is byte for byte this process's
    ours = {k: v.replace(str(folder).encode(), str(theirs).encode()) for k, v in contents(folder).items()}
    assert contents(theirs).keys() == ours.keys()
    for name, data in contents(theirs).items():
        if name != "manifest.json":  # it records the inputs' fingerprint, the folder's path among them
            assert data == ours[name], name
    assert not list(tmp_path.rglob("*.tmp"))


def test_each_question_has_four_choices_the_gold_among_them(folder: Path) -> None:
    verses = {v.reference: v for v in kjv_verses()}
    before = {v.reference: w.text for w, v in itertools.pairwise(kjv_verses()) if w.book == v.book}
    for task in MC_TASKS:
        for row in rows(folder, task):
            assert len(row["choices"]) == len(set(row["choices"])) == 4
            # lm-eval fails on a choice longer than the model's context: each fits the lm task's 128 bytes
            assert max(len(c) for c in row["choices"]) <= 96
            gold, text = row["choices"][row["label"]], verses[row["reference"]].text
            if task == "kjv_next_words":
                assert f"{row['context']} {gold}" == f"{before[row['reference']]}\n{text}"
            elif task == "kjv_cloze":
                assert f"{row['prefix']} {gold}" == text
                assert [c.startswith(w) for c, w in zip(row["choices"], row["words"], strict=True)] == [
                    True
                ] * 4
            else:
                assert gold == verses[row["reference"]].book and row["question"].endswith(text)
    for row in rows(folder, "kjv_book_gen"):
        assert row["book"] == verses[row["reference"]].book


def test_no_two_choices_of_the_group_are_one_text_split_two_ways(folder: Path) -> None:
    # lm-eval's HFLM runs one forward pass for requests whose context and continuation agree but for the last
    # token, and scores each with that pass's logits: the same text split at two places got a wrong score
    splits: dict[str, set[int]] = {}
    for task in MC_TASKS:
        for row in rows(folder, task):
            context = row.get("context") or row.get("prefix") or row["question"] + "\nAnswer:"
            for choice in row["choices"]:
                splits.setdefault(f"{context} {choice}", set()).add(len(context))
    assert not {text: at for text, at in splits.items() if len(at) > 1}


def test_every_question_is_about_a_verse_no_training_set_holds(folder: Path) -> None:
    lm_train = "".join(kjv().train)  # the `kjv` LM corpus's training text at its default split
    chat_train = {m[0]["content"] for m in chat().train}  # the chat fine-tune's training questions
    for task in TASKS:
        refs = [r["reference"] for r in rows(folder, task)]
        assert 200 <= len(refs) == len(set(refs)) <= 400  # a few hundred questions, one per verse
        held = [v for v in kjv_verses() if v.reference in set(refs)]
        assert all(in_validation(v.reference, VAL_FRACTION) for v in held)
        assert not [v.reference for v in held if v.text in lm_train]
        assert not [r["question"] for r in rows(folder, task) if r.get("question") in chat_train]


def test_baselines(folder: Path) -> None:
    assert [baseline(t) for t in MC_TASKS] == [0.25] * 3
    books = [r["book"] for r in rows(folder, "kjv_book_gen")]
    assert baseline("kjv_book_gen") == max(books.count(b) for b in books) / len(books)
    with pytest.raises(ConfigError) as err:
        baseline("kjv_psalms")
    assert fault(err.value)[:2] == ("task", "kjv_psalms")


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No download, and Hugging Face's caches in `tmp_path`, for this test's lm-eval."""
    for key, value in {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read at import, which may have been
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")


def test_every_task_loads_through_lm_eval_offline(folder: Path, offline: None) -> None:
    tasks = pytest.importorskip("lm_eval.tasks", reason="lm-eval (the `eval` extra) is not installed")
    manager = tasks.TaskManager(include_path=str(folder), include_defaults=False)
    loaded = manager.load(["kjv"])  # the group: every task, each reading its JSONL
    assert loaded["group_map"] == {"kjv": list(TASKS)}
    for name, task in loaded["tasks"].items():
        docs = list(task.test_docs())
        assert len(docs) == len(rows(folder, name))
        first = docs[0]
        if name == "kjv_book_gen":
            assert task.doc_to_target(first) == first["book"]
        else:
            assert task.doc_to_choice(first)[task.doc_to_target(first)] == first["choices"][first["label"]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer transformers Llama saved with torchkiln's byte tokenizer in Hugging Face form."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the `hf` extra) is not installed"
    )
    import torch

    from text.tokenizer import ByteTokenizer, write_hf_tokenizer

    folder = tmp_path_factory.mktemp("tiny_llama")
    tok = ByteTokenizer()
    ids = write_hf_tokenizer(tok, folder, context=1024)
    config = transformers.LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,  # the longest prompt and choice, in bytes, fit
        **ids,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_lm_eval_scores_a_tiny_llama_on_the_kjv_group_offline(
    folder: Path, tiny_llama: Path, offline: None
) -> None:
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval (the `eval` extra) is not installed")
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    # one thread: a 32-wide model's matmuls gain nothing from more, and on a busy machine two threads made
    # them wait on each other (4.2 s against 1.2 s for this evaluation)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = HFLM(pretrained=str(tiny_llama), device="cpu", batch_size=8, max_length=1024)
        manager = TaskManager(include_path=str(folder), include_defaults=False)
        results = lm_eval.simple_evaluate(model=model, tasks=["kjv"], task_manager=manager, limit=5)[
            "results"
        ]
    finally:
        torch.set_num_threads(threads)
    for task in MC_TASKS:
        assert 0 <= results[task]["acc,none"] <= 1 and 0 <= results[task]["acc_norm,none"] <= 1
    assert 0 <= results["kjv_book_gen"]["exact_match,strip"] <= 1
