"""Chat fine-tuning (`+task=sft`, text/chat.py and text/sft.py): chat templates render as transformers'
`apply_chat_template` renders them (the test-only `hf` extra), the loss mask covers the assistant's text and
nothing else, generation prompts tokenize as training did, packing keeps conversations whole, a template
cannot reach Python internals, bad conversations are one line naming the file, line and key (exit 2), and
the recipe fine-tunes a Hugging Face folder with its own tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import DataError
from tests.helpers import read_metrics, run_here, train
from text.chat import CHATML, ChatTemplate, encode_conversation, prompt_ids, read_conversations
from text.lm_data import IGNORE
from text.sft import EncodedConversations, PackedConversations
from text.tokenizer import ByteTokenizer

# the turn formats of three model families, written here as their folders ship them: Qwen2.5's (a default
# system turn), Llama 3's (bos_token, trimmed content, headers) and one that refuses a system turn
QWEN = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% generation %}"
    "<start_of_turn>model\n{{ message['content'] }}<end_of_turn>\n{% endgeneration %}"
    "{% else %}<start_of_turn>user\n{{ message['content'] }}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TEMPLATES = {"chatml": CHATML, "qwen": QWEN, "llama3": LLAMA3, "no_system": NO_SYSTEM}
CONV = [
    {"role": "system", "content": "Answer with one word."},
    {"role": "user", "content": "Which book holds this verse? In the beginning God created the heaven."},
    {"role": "assistant", "content": "Genesis"},
    {"role": "user", "content": "And this one? The LORD is my shepherd; I shall not want."},
    {"role": "assistant", "content": " Psalms "},
]


def _conv(name: str) -> list[dict[str, str]]:
    return CONV[1:] if name == "no_system" else CONV


@pytest.mark.parametrize("name", TEMPLATES)
def test_templates_render_as_transformers_renders_them(name: str) -> None:
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the `hf` extra) is not installed"
    )
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|eos|>"
    )
    ours = ChatTemplate(TEMPLATES[name], bos_token="<|bos|>", eos_token="<|eos|>")
    conv = _conv(name)
    for upto in (2, 3, len(conv)):
        for gen in (False, True):
            want = hf.apply_chat_template(
                conv[:upto], chat_template=TEMPLATES[name], tokenize=False, add_generation_prompt=gen
            )
            assert ours.render(conv[:upto], add_generation_prompt=gen) == want
    if name == "no_system":  # the template's own refusal, as a DataError naming the template
        with pytest.raises(DataError):
            ours.render(CONV)


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_loss_mask_covers_the_assistant_turns_alone(name: str) -> None:
    template, tok, conv = ChatTemplate(TEMPLATES[name], bos_token="<|bos|>"), ByteTokenizer(), _conv(name)
    ids, mask = encode_conversation(conv, template, tok)
    assert ids[0] == tok.eos_id and tok.decode(ids[1:]) == template.render(conv)  # the whole text, in order
    trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    end = template.end_of_turn()
    answers = [m["content"] for m in conv if m["role"] == "assistant"]
    # each answer and the end of its turn (Llama 3's template trims the content); nothing of the prompts
    if name == "llama3":
        answers = [a.strip() for a in answers]
    assert trained.replace("\n", "") == "".join(a + end for a in answers).replace("\n", "")
    assert end  # every family here closes a turn with a marker generation stops at
    # the prompt before the last answer tokenizes as the same ids the training text holds
    cut = len(conv) - 1
    prompt = prompt_ids(conv[:cut], template, tok)
    assert ids[: len(prompt)] == prompt and mask[len(prompt)] and not mask[len(prompt) - 1]


def test_packing_keeps_conversations_whole_and_targets_only_the_assistant() -> None:
    convs = [([9, 1, 2, 3], [False, False, True, True]), ([9, 4, 5], [False, True, True])] * 3
    convs.append(([9] + [6] * 12, [False] + [True] * 12))  # longer than a row: cut to it
    ds = PackedConversations(EncodedConversations(convs), context=7, pad_id=0)
    assert len(ds) == 4 and ds.cut == 1  # 4+3 | 4+3 | 4+3 | the long one, cut to 8 tokens
    x, y, d = ds[0]
    assert x.tolist() == [9, 1, 2, 3, 9, 4, 5] and d.tolist() == [0, 0, 0, 0, 1, 1, 1]
    # targets: the assistant's tokens of the same conversation; the next conversation's first token is not
    assert y.tolist() == [IGNORE, 2, 3, IGNORE, 4, 5, IGNORE]
    x, y, d = ds[3]
    assert x.tolist() == [9] + [6] * 6 and y.tolist() == [6] * 7
    assert ds.assistant_tokens == 3 * 4 + 7


def test_a_template_cannot_reach_python_internals() -> None:
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", origin="evil.jinja")
    with pytest.raises(DataError) as e:
        evil.render(CONV)
    assert e.value.key == "chat_template"


def test_a_bad_conversation_is_one_line_naming_file_line_and_key(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (good, bad, good)) + "\n")
    with pytest.raises(DataError) as e:
        read_conversations(path)
    assert (e.value.key, e.value.value) == ("data.max_bad_fraction", "1/3")  # one bad of 3: past the 1%
    assert f"{path}:2" in str(e.value) and "messages[1].role" in str(e.value)
    args = ["+task=sft", "trainer=smoke", f"data.train={path}", "logger=none"]
    r = run_here("recipes.train", *args, f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert f"{path}:2" in line and "messages[1].role" in line
    assert not (tmp_path / "run" / "checkpoints").exists()  # before any training
    assert len(read_conversations(path, _skip())) == 2  # data.on_bad_sample=skip keeps the good ones


def _skip() -> object:
    from core.data.bad_samples import BadSamplePolicy

    return BadSamplePolicy(on_bad_sample="skip", max_bad_fraction=0.5)


def _check_the_export_answers_as_the_run(
    transformers: Any, run: Path, folder: Path, question: str, answer: str
) -> None:
    """The run's `format=hf` export keeps the folder's tokenizer and template and answers `question` as the
    run did; an export onto the source folder is refused."""
    from recipes.cli.runs import load_run

    loaded = load_run(run, device="cpu")
    user = [{"role": "user", "content": question}]
    # exported as a Hugging Face folder, the run keeps the folder's tokenizer and template, copied as they are
    assert run_here("recipes.export", f"ckpt={run}", "format=hf").returncode == 0
    out = run / "export" / "hf"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes()
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = theirs.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert text == loaded.task.template.render(user, add_generation_prompt=True)
    # recipes.generate chat=true on the folder answers in its template as on the run: the same reply
    asked = [f"ckpt={out}", f"prompt={question}", "temperature=0", "max_new_tokens=6", "precision=fp32"]
    chat = run_here("recipes.generate", *asked, "chat=true")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == answer
    as_chat = load_run(out, device="cpu", hf_task="sft").task  # what chat=true loads: the folder's template
    assert "You are a helpful assistant." in as_chat.template.render(user, add_generation_prompt=True)
    plain = run_here("recipes.generate", *asked)  # without chat=true: the prompt continued, prompt first
    assert plain.returncode == 0 and plain.stdout.startswith(question)
    refused = run_here("recipes.generate", f"ckpt={run}", f"prompt={question}", "chat=true")
    assert refused.returncode == 2 and "chat" in refused.stderr
    # the folder the run was loaded from is never the export's: one line, exit 2, the folder untouched
    before = {f.name: f.read_bytes() for f in folder.iterdir()}
    refused = run_here("recipes.export", f"ckpt={run}", "format=hf", f"out={folder}")
    assert refused.returncode == 2 and "model.weights" in refused.stderr
    assert {f.name: f.read_bytes() for f in folder.iterdir()} == before


def _qwen_chat_folder(transformers: Any, tmp_path: Path) -> tuple[Path, Path]:
    """A tiny Qwen2 folder with a BPE tokenizer and the Qwen template, and 40 arithmetic chats beside it."""
    from text.tokenizer import BPETokenizer

    folder = tmp_path / "qwen"
    chats = [
        [{"role": "user", "content": f"What is {i} plus one?"}, {"role": "assistant", "content": f"{i + 1}"}]
        for i in range(40)
    ]
    tok = BPETokenizer.train(
        [QWEN] + [m["content"] for c in chats for m in c], 300, cache_dir=tmp_path / "bpe"
    )
    config = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=tok.eos_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN, "eos_token": "<eos>"}))
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return folder, data


def test_the_recipe_fine_tunes_an_hf_folder_with_its_tokenizer_and_template(tmp_path: Path) -> None:
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the `hf` extra) is not installed"
    )
    folder, data = _qwen_chat_folder(transformers, tmp_path)
    args = ["+task=sft", f"model.weights={folder}", "tokenizer=pretrained", f"data.train={data}"]
    args += ["trainer=smoke", "task.context=128", "task.eval_questions=3", "logger=none", "precision=fp32"]
    run = train(tmp_path / "run", args)
    rows = [r for r in read_metrics(run) if "val/exact_match" in r]
    # trainer.eval_on_start: the folder's model measured first, then at each epoch's end and the last step
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 5
    assert all(0 <= r["val/exact_match"] <= 1 for r in rows)
    assert rows[0]["val/majority_baseline"] == 0  # every answer differs
    # the folder's template framed the training text: its default system turn is in the packed rows
    from text.sft import ChatFineTuning

    task = ChatFineTuning(
        model={"name": "llama", "weights": str(folder)},
        data={"name": "chat", "train": str(data)},
        tokenizer="pretrained",
        context=128,
    )
    x = task.build_datasets()[0][0][0]
    assert "You are a helpful assistant." in task.tokenizer.decode(x.tolist())
    # recipes.generate on the run answers a prompt as one user message in the template: the reply alone
    from recipes.cli.runs import load_run

    question = "What is 3 plus one?"
    r = run_here("recipes.generate", f"ckpt={run}", f"prompt={question}", "temperature=0", "max_new_tokens=6")
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = load_run(run, device="cpu")
    user = [{"role": "user", "content": question}]
    want = loaded.task.reply(loaded.model, user, max_new_tokens=6, temperature=0.0)
    assert r.stdout == want + "\n" and question not in r.stdout  # print adds the one newline
    _check_the_export_answers_as_the_run(transformers, run, folder, question, r.stdout)


def test_sft_micro_batches_accumulate_to_one_batch_weighted_by_assistant_token(tmp_path: Path) -> None:
    from torch.utils.data import default_collate

    from tests.core.accumulation_reference import (
        accumulated_grads,
        max_deviation,
        mean_of_means_grads,
        one_batch_grads,
    )
    from text.sft import ChatFineTuning

    # answers of very different lengths: rows hold unequal counts of the assistant tokens the loss averages
    chats = [
        [
            {"role": "user", "content": f"Say {i}"},
            {"role": "assistant", "content": "word " * (1 + 7 * (i % 3))},
        ]
        for i in range(24)
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    model_cfg = {"name": "llama", "n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "hidden": 64}
    task = ChatFineTuning(model=model_cfg, data={"name": "chat", "train": str(data)}, context=96)
    train, _ = task.build_datasets()
    torch.manual_seed(0)
    model = task.build_model().double()
    items = [train[i] for i in range(5)]
    micro = [default_collate(items[:2]), default_collate(items[2:])]
    units = [task.loss_units(b) for b in micro]
    assert units[0] / 2 != units[1] / 3  # unequal assistant tokens per row: a mean of means would be off

    def ready(m: torch.nn.Module, b: object) -> object:
        return b

    want = one_batch_grads(task, model, default_collate(items), ready)
    assert max_deviation(accumulated_grads(task, model, micro, ready), want) < 1e-10  # float64
    assert max_deviation(mean_of_means_grads(task, model, micro, ready), want) > 1e-6


class _BosBytes(ByteTokenizer):
    """Bytes, plus a BOS id (258) that "<|bos|>" in text encodes to, as a Llama 3 tokenizer.json's
    `<|begin_of_text|>` special token does."""

    vocab_size = 259

    @property
    def doc_start_id(self) -> int:
        return 258

    def encode(self, text: str) -> list[int]:
        parts = [super(_BosBytes, self).encode(p) for p in text.split("<|bos|>")]
        return [t for i, p in enumerate(parts) for t in ([258] if i else []) + p]


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_a_conversation_starts_with_the_tokenizers_document_start_once(name: str) -> None:
    # Llama 3's template writes bos_token itself: the ids start with one BOS, not an added one before it
    template, tok = ChatTemplate(TEMPLATES[name], bos_token="<|bos|>"), _BosBytes()
    ids, mask = encode_conversation(CONV, template, tok)
    assert ids[0] == 258 and ids[1] != 258 and not mask[0]
    prompt = prompt_ids(CONV[:2], template, tok)
    assert prompt[0] == 258 and prompt[1] != 258 and ids[: len(prompt)] == prompt


def test_a_folder_with_a_bos_token_starts_its_documents_with_it(tmp_path: Path) -> None:
    from text.lm_data import PackedChunks
    from text.tokenizer import BPETokenizer, PretrainedTokenizer

    tok = BPETokenizer.train(["in the beginning was the word"] * 4, 300, cache_dir=tmp_path / "bpe")
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(
        json.dumps({"eos_token_id": tok.eos_id, "bos_token_id": tok.pad_id})
    )
    theirs = PretrainedTokenizer(tmp_path)
    assert (theirs.doc_start_id, theirs.eos_id) == (tok.pad_id, tok.eos_id)
    chunks = PackedChunks(
        [theirs.encode("in the beginning")] * 3, 4, theirs.eos_id, start_id=theirs.doc_start_id
    )
    assert chunks.tokens[0] == tok.pad_id and chunks.tokens.tolist().count(tok.pad_id) == 3
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": tok.eos_id}))
    assert PretrainedTokenizer(tmp_path).doc_start_id == tok.eos_id  # no BOS named: documents start at eos


def test_a_folder_whose_tokenizer_config_is_not_json_is_one_data_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ x }}"')  # cut short
    with pytest.raises(DataError) as e:
        ChatTemplate.of_folder(tmp_path)
    assert e.value.key == "chat_template" and str(tmp_path / "tokenizer_config.json") in str(e.value)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN}))
    assert ChatTemplate.of_folder(tmp_path).render(CONV[1:3]) == ChatTemplate(QWEN).render(CONV[1:3])
