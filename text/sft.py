"""Chat fine-tuning (`+task=sft`): a decoder (model=llama, usually `model.weights=DIR` of a Hugging Face
folder or of a run exported with `recipes.export format=hf`) trained on conversations (`text.chat`), the
loss on the assistant's tokens alone.

Conversations are packed whole, in order, into rows of `task.context` tokens (a conversation is never cut
between rows, so no answer loses its question; a longer one is cut to the context), each attending within
itself (`doc_ids`, positions restart). Targets outside assistant turns are IGNOREd, so the loss is a mean
over assistant tokens, weighted by token over accumulation and ranks (the lm task's `loss_units`).

Evaluation adds `exact_match`: the share of the first `task.eval_questions` validation conversations whose
last assistant message the model gives word for word, greedily, from the conversation before it; and
`majority_baseline`: the share that the commonest training answer would get.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from core import compile as kc
from core.bounds import Bounds
from core.errors import ConfigError, DataError
from core.logging.messages import warn
from core.registry import DATASETS, TASKS
from text.chat import CHATML, ChatCorpus, ChatTemplate, Conversation, encode_conversation, prompt_ids
from text.chat_shards import ConversationShards, chat_manifest, check_template, mask_split, val_conversations
from text.lm import LanguageModeling
from text.lm_data import IGNORE, TokenCorpus
from text.tokenizer import Tokenizer, check_same_tokenizer


class ConversationSource(Protocol):
    """Tokenized conversations, wherever they are held: each one's length, and its ids and loss mask."""

    lengths: np.ndarray

    def read(self, n: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, loss mask) of conversation `n`, cut to `width`."""
        ...


class EncodedConversations:
    """Tokenized conversations held in memory, (ids, loss mask) each, read as `ConversationShards` reads."""

    def __init__(self, convs: Sequence[tuple[list[int], list[bool]]]) -> None:
        """Hold `convs`; none is a DataError."""
        if not convs:
            raise DataError("no conversations to pack")
        self.convs = [(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)) for ids, mask in convs]
        #: each conversation's number of ids
        self.lengths = np.array([len(ids) for ids, _ in convs], dtype=np.int64)

    def read(self, n: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, loss mask) of conversation `n`, cut to `width`."""
        ids, mask = self.convs[n]
        return ids[:width], mask[:width]


def row_starts(lengths: np.ndarray, width: int) -> np.ndarray:
    """The first conversation of each row when conversations of `lengths` (each cut to `width`) are packed
    whole, in order: a row takes the next one while it fits."""
    firsts, fill = [], width + 1
    for n, length in enumerate(np.minimum(lengths, width).tolist()):
        if fill + length > width:
            firsts.append(n)
            fill = 0
        fill += length
    return np.asarray(firsts, dtype=np.int64)


def pack_row(
    parts: list[tuple[int, np.ndarray, np.ndarray]], width: int, pad_id: int, pad_doc: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, keep, doc_ids), each (`width`,), of conversations (index, ids, loss mask) packed in order;
    the rest of the row is `pad_id`, kept out of the loss, one more document (`pad_doc`)."""
    tokens = torch.full((width,), pad_id, dtype=torch.long)
    keep = torch.zeros(width, dtype=torch.bool)
    doc_ids = torch.full((width,), pad_doc, dtype=torch.long)
    at = 0
    for n, ids, mask in parts:
        end = at + len(ids)
        tokens[at:end], keep[at:end], doc_ids[at:end] = torch.as_tensor(ids), torch.as_tensor(mask), n
        at = end
    return tokens, keep, doc_ids


class PackedConversations(Dataset):
    """Tokenized conversations packed whole into rows of `context` + 1 tokens, the rest of a row padding,
    whether they are held in memory (`EncodedConversations`) or in prepared shards
    (`text.chat_shards.ConversationShards`): the same conversations make the same rows. A row is packed when
    it is read; what is held is each row's first conversation.

    Item i is (inputs, targets, doc_ids) as the lm task's chunks: targets are the inputs shifted by one, with
    IGNORE where the next token is not the assistant's, belongs to another conversation, or is padding.
    """

    def __init__(self, source: ConversationSource, context: int, pad_id: int) -> None:
        """Pack `source`'s conversations in order; one longer than `context` + 1 is cut to it."""
        self.source, self.context, self.pad_id = source, context, pad_id
        width = context + 1
        self.firsts = row_starts(source.lengths, width)
        #: conversations cut to a row
        self.cut = int((source.lengths > width).sum())

    @functools.cached_property
    def assistant_tokens(self) -> int:
        """The ids the loss is on, over every row (each conversation as cut to a row)."""
        width = self.context + 1
        return sum(int(self.source.read(n, width)[1].sum()) for n in range(len(self.source.lengths)))

    def __len__(self) -> int:
        return len(self.firsts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width, count = self.context + 1, len(self.source.lengths)
        last = self.firsts[i + 1] if i + 1 < len(self.firsts) else count
        parts = [(n, *self.source.read(n, width)) for n in range(int(self.firsts[i]), int(last))]
        t, k, d = pack_row(parts, width, self.pad_id, count)
        y = t[1:].masked_fill(~k[1:] | (d[1:] != d[:-1]), IGNORE)
        return t[:-1], y, d[:-1]


@TASKS.register("sft")
class ChatFineTuning(LanguageModeling):
    """Next-token prediction on the assistant turns of packed conversations; greedy exact-match answers."""

    data_type = (ChatCorpus, TokenCorpus)

    def __init__(
        self,
        *,
        model: dict[str, Any],
        data: dict[str, Any],
        tokenizer: str = "bytes",
        bpe_vocab_size: Annotated[int, Bounds(ge=1)] = 2048,
        context: Annotated[int, Bounds(ge=1)] = 256,
        eval_questions: Annotated[int, Bounds(ge=0)] = 200,
    ) -> None:
        """`model`/`data` are config sections (a registered `name` plus that builder's keywords).

        tokenizer: bytes, bpe (learned on the training conversations) or pretrained (the model.weights
            folder's tokenizer.json, and its chat template); tokenizer=NAME sets it too
        bpe_vocab_size: vocabulary size the bpe tokenizer learns
        context: tokens per packed row: the longest conversation trained whole
        eval_questions: validation conversations answered greedily for exact_match (0: none)
        """
        super().__init__(
            model=model, data=data, tokenizer=tokenizer, bpe_vocab_size=bpe_vocab_size, context=context
        )
        self.eval_questions = eval_questions

    @functools.cached_property
    def corpus(self) -> ChatCorpus | TokenCorpus:  # type: ignore[override]
        """Training and validation conversations (or their prepared shards: data=tokens), read once."""
        corpus = DATASETS.build_section(self.data_cfg)
        if isinstance(corpus, TokenCorpus):
            chat_manifest(corpus.shards)
            if len(corpus.train) > 1:
                raise ConfigError(
                    "+task=sft trains from one prepared folder: set data.path, not data.sources",
                    key="data.sources",
                    value=str(self.data_cfg.get("sources")),
                )
            return corpus
        if not corpus.val:
            raise DataError(
                "no validation conversations; give data.val or raise data.val_fraction", key="data.val"
            )
        return corpus

    @functools.cached_property
    def val_conversations(self) -> list[Conversation]:
        """The validation conversations as messages (exact-match evaluation asks them)."""
        if isinstance(self.corpus, TokenCorpus):
            return val_conversations(self.corpus.shards)
        return self.corpus.val

    @functools.cached_property
    def majority_answer(self) -> str:
        """The commonest last answer of the training conversations (`majority_baseline`)."""
        if isinstance(self.corpus, TokenCorpus):
            return str(chat_manifest(self.corpus.shards)["majority_answer"])
        return collections.Counter(_last_answer(m) for m in self.corpus.train).most_common(1)[0][0]

    @functools.cached_property
    def template(self) -> ChatTemplate:
        """The chat template: the model.weights folder's with tokenizer=pretrained, else ChatML."""
        return (
            ChatTemplate.of_folder(self.tokenizer_spec.folder)
            if self.tokenizer_spec.folder
            else ChatTemplate(CHATML)
        )

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer (bpe: fitted on the rendered training conversations)."""
        if self.run_tokenizer is not None and self.data_cfg.get("name") != "tokens":
            return self.run_tokenizer  # a trained run's own vocabulary (load_artifacts), not one fitted again
        if isinstance(self.corpus, TokenCorpus):
            tok = self.corpus.tokenizer(self.tokenizer_spec)
            check_same_tokenizer(tok, self.run_tokenizer, f"data.path={self.corpus.shards.root}")
            check_template(self.corpus.shards, self.template)
            return tok
        if self.tokenizer_spec.name == "pretrained":
            return self.tokenizer_spec.fit([])
        return self.tokenizer_spec.fit(self.training_texts())

    def training_texts(self) -> list[str]:
        """The rendered training conversations, which a bpe tokenizer learns from."""
        return [self.template.render(m) for m in self.corpus.train]

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """The training and validation conversations, tokenized and packed (`PackedConversations`)."""
        tok, template = self.tokenizer, self.template
        corpus = self.corpus
        sources: list[ConversationSource] = []
        if isinstance(corpus, TokenCorpus):
            chat = chat_manifest(corpus.shards)
            for split, tokens in (("train", corpus.train[0]), ("val", corpus.val[0])):
                if not chat["assistant_tokens"][split]:
                    raise DataError(f"{corpus.shards.root}: no assistant token in its {split} conversations")
                sources.append(ConversationShards(tokens, mask_split(corpus.shards, split)))
        else:
            for split in (corpus.train, corpus.val):
                sources.append(EncodedConversations([encode_conversation(m, template, tok) for m in split]))
        parts = [PackedConversations(source, self.context, tok.pad_id) for source in sources]
        for ds in parts:
            if isinstance(ds.source, EncodedConversations) and ds.assistant_tokens == 0:
                raise DataError(
                    "no assistant token fits task.context; raise task.context", key="task.context"
                )
            if ds.cut:
                warn(
                    f"{ds.cut} conversation(s) longer than task.context={self.context} tokens were cut to it"
                )
        return parts[0], parts[1]

    def evaluate(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        """The loss per assistant token over `batches`, and exact-match answers (module docstring)."""
        loss_sum, tokens = 0.0, 0
        for batch in batches:
            kept = int((batch[1] != IGNORE).sum())
            loss_sum += float(self.step(model, batch).loss) * kept
            tokens += kept
        out = {"loss": loss_sum / max(tokens, 1)}
        if self.eval_questions:
            out.update(self.exact_match(model, self.val_conversations[: self.eval_questions]))
        return out

    def exact_match(self, model: nn.Module, convs: list[Conversation]) -> dict[str, float]:
        """`exact_match` and `majority_baseline` over `convs`' last assistant messages (module docstring)."""
        common = self.majority_answer
        right = majority = 0
        for messages in convs:
            cut = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            want = messages[cut]["content"].strip()
            right += self.greedy_answer(model, messages[:cut], want) == want
            majority += want == common
        n = max(len(convs), 1)
        return {"exact_match": right / n, "majority_baseline": majority / n}

    def greedy_answer(self, model: nn.Module, messages: Conversation, want: str) -> str:
        """The model's greedy reply to `messages`, stripped, given room for `want` (the answer it is measured
        against), the template's end of turn and 8 tokens more."""
        tok = self.tokenizer
        budget = len(tok.encode(want)) + len(tok.encode(self.template.end_of_turn())) + 8
        return self.reply(model, messages, max_new_tokens=budget, temperature=0.0).strip()

    def reply(self, model: nn.Module, messages: Conversation, **options: Any) -> str:
        """The assistant's next message after `messages`, sampled with `LanguageModeling.continue_ids`'s
        `options` (temperature 0: greedy); it ends at the template's end of turn (left out), a document end,
        `max_new_tokens`, or just before the first `stop` string."""
        tok = self.tokenizer
        # generation's lengths vary each step: compiled code (regional or full) would recompile for each
        with kc.run_eagerly():
            return self.continue_ids(
                model,
                prompt_ids(messages, self.template, tok),
                echo=False,
                end=tok.encode(self.template.end_of_turn()),
                **options,
            )

    def generate(self, model: nn.Module, prompt: str, **options: Any) -> str:
        """The assistant's reply to `prompt` asked as one user message in the run's chat template (what
        `recipes.generate ckpt=RUN prompt=...` prints for an sft run); `options` as the lm task's."""
        return self.reply(model, [{"role": "user", "content": prompt}], **options)


def _last_answer(messages: Conversation) -> str:
    return [m["content"] for m in messages if m["role"] == "assistant"][-1].strip()
