"""Preference pairs for preference tuning (`+task=dpo`): JSONL in TRL's preference layout, read, checked,
tokenized and batched.

A line is `{"prompt", "chosen", "rejected"}` in one of TRL's two forms:

- text: three strings. The prompt starts a document (`Tokenizer.doc_start_id`) and each completion ends
  with the end of document (TRL adds the tokenizer's EOS the same way); each is tokenized on its own.
- conversational: `prompt` a message list that ends before the assistant's turn, `chosen` and `rejected`
  each a list of one assistant message. Both completions are rendered after the prompt with the model's
  chat template and tokenized exactly as `+task=sft` tokenizes a conversation (`text.chat`): the prompt's
  ids are `prompt_ids`, what `encode_conversation` adds after them is the completion.

The loss is on the completion tokens alone. A line that is not a pair (a missing key, an empty completion,
a chosen equal to its rejected, a completion that is not one assistant message) goes by
`data.on_bad_sample` and `data.max_bad_fraction`, named `file:line` with the key at fault: by default (every
data section's: skip, at most 1%) a file with more bad pairs than that stops the run before training (exit
2), and `data.on_bad_sample=error` stops it at the first one.

With no `data.train`, the embedded KJV questions ("Which book holds this verse?", `text.chat.kjv_questions`)
become pairs: chosen the right book, rejected another of the five books, picked from a hash of the verse's
reference.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
from torch.utils.data import Dataset

from core.bounds import Bounds
from core.data.bad_samples import DEFAULT_POLICY, BadSamplePolicy
from core.registry import DATASETS
from text.chat import (
    KJV_BOOKS,
    ChatTemplate,
    Conversation,
    encode_conversation,
    kjv_questions,
    messages_fault,
    prompt_ids,
    read_rows,
    split_examples,
)
from text.lm_data import IGNORE
from text.tokenizer import Tokenizer

#: the keys of a preference line, in TRL's layout
KEYS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class PreferencePair:
    """A prompt and two completions, the chosen one preferred: strings (text form) or messages."""

    prompt: str | Conversation
    chosen: str | Conversation
    rejected: str | Conversation

    @property
    def conversational(self) -> bool:
        """Whether the pair is messages (rendered with the chat template) rather than text."""
        return not isinstance(self.prompt, str)

    def chosen_conversation(self) -> Conversation:
        """The prompt and the chosen answer as one conversation (conversational pairs)."""
        assert isinstance(self.prompt, list) and isinstance(self.chosen, list)
        return [*self.prompt, *self.chosen]


@dataclass
class PreferenceCorpus:
    """Training and validation preference pairs."""

    train: list[PreferencePair]
    val: list[PreferencePair]


def _completion_fault(value: Any, key: str, conversational: bool) -> str | None:
    """Why `value` is not a completion of the pair's form (None: it is one)."""
    if not conversational:
        if not isinstance(value, str):
            return f"'{key}' is not a string (the prompt is)"
        return f"'{key}' is empty" if not value.strip() else None
    why = messages_fault(value, key)
    if why is not None:
        return why
    if value[-1]["role"] != "assistant":
        return f"'{key}': its last message is not the assistant's"
    if len(value) != 1:
        return f"'{key}' holds {len(value)} messages, not one assistant message"
    return f"'{key}' is empty" if not value[0]["content"].strip() else None


def pair_fault(row: dict[str, Any]) -> str | None:
    """Why a JSONL row is not a preference pair (None: it is one), naming the key at fault."""
    for key in KEYS:
        if key not in row:
            return f"no '{key}' key"
    prompt = row["prompt"]
    conversational = not isinstance(prompt, str)
    if conversational:
        why = messages_fault(prompt, "prompt")
        if why is not None:
            return why
        if prompt[-1]["role"] == "assistant":
            return "'prompt' ends with the assistant's message: its answer is 'chosen'/'rejected'"
    for key in ("chosen", "rejected"):
        why = _completion_fault(row[key], key, conversational)
        if why is not None:
            return why
    if row["chosen"] == row["rejected"]:
        return "'rejected' equals 'chosen': the pair prefers nothing"
    return None


def read_pairs(path: str | Path, policy: BadSamplePolicy = DEFAULT_POLICY) -> list[PreferencePair]:
    """The preference pairs of a JSONL file, one `{"prompt", "chosen", "rejected"}` object a line; a line
    that is not one goes by `policy` (data.on_bad_sample), named path:line with the key at fault."""
    rows = read_rows(path, policy, pair_fault, '{"prompt", "chosen", "rejected"}', "preference pairs")
    return [PreferencePair(*(_plain(row[k]) for k in KEYS)) for row in rows]


def _plain(value: str | list[dict[str, Any]]) -> str | Conversation:
    """A pair's value with each message cut to its role and content."""
    if isinstance(value, str):
        return value
    return [{"role": m["role"], "content": m["content"]} for m in value]


def kjv_pairs(per_book: int, max_chars: int) -> list[tuple[str, PreferencePair]]:
    """(reference, pair) of the embedded questions: chosen the verse's book, rejected another of
    `KJV_BOOKS` picked from a hash of the reference (the same pair every run)."""
    out = []
    for ref, messages in kjv_questions(per_book, max_chars):
        book = messages[-1]["content"]
        others = [b for b in KJV_BOOKS if b != book]
        wrong = others[zlib.crc32(ref.encode()) % len(others)]
        answer = [{"role": "assistant", "content": wrong}]
        out.append((ref, PreferencePair(messages[:-1], messages[-1:], answer)))
    return out


@DATASETS.register("preference")
def preference(
    *,
    train: str = "",
    val: str = "",
    val_fraction: Annotated[float, Bounds(gt=0, lt=1)] = 0.1,
    per_book: Annotated[int, Bounds(ge=1)] = 400,
    max_chars: Annotated[int, Bounds(ge=1)] = 150,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> PreferenceCorpus:
    """Preference pairs for preference tuning: JSONL files of {"prompt", "chosen", "rejected"} (TRL's layout,
    text or conversational), or with no `train` the embedded KJV questions, the right book chosen over a
    wrong one (split by a hash of the verse's reference).

    train: the training pairs, .jsonl (empty: the embedded KJV questions)
    val: the validation pairs, .jsonl (empty: the last val_fraction of train's, in file order)
    val_fraction: the share held out for validation when no `val` file is given
    per_book: the embedded questions: verses asked about per book
    max_chars: the embedded questions: longest verse asked about, in characters
    """
    return PreferenceCorpus(
        *split_examples(
            train,
            val,
            val_fraction,
            lambda: kjv_pairs(per_book, max_chars),
            lambda path: read_pairs(path, policy),
        )
    )


#: a tokenized pair: (prompt ids, chosen completion ids, rejected completion ids)
EncodedPair = tuple[list[int], list[int], list[int]]


def encode_pair(pair: PreferencePair, template: ChatTemplate, tok: Tokenizer) -> EncodedPair:
    """The ids of `pair`'s prompt and of each completion (module docstring)."""
    if isinstance(pair.prompt, str):
        assert isinstance(pair.chosen, str) and isinstance(pair.rejected, str)
        head = [tok.doc_start_id, *tok.encode(pair.prompt)]
        return head, [*tok.encode(pair.chosen), tok.eos_id], [*tok.encode(pair.rejected), tok.eos_id]
    head = prompt_ids(pair.prompt, template, tok)
    completions = []
    for answer in (pair.chosen, pair.rejected):
        assert isinstance(answer, list)
        ids, _ = encode_conversation([*pair.prompt, *answer], template, tok)
        completions.append(ids[len(head) :])
    return head, completions[0], completions[1]


def pair_texts(pair: PreferencePair, template: ChatTemplate) -> list[str]:
    """The text of the prompt with each completion (what a bpe tokenizer learns from)."""
    if isinstance(pair.prompt, str):
        return [f"{pair.prompt}{pair.chosen}", f"{pair.prompt}{pair.rejected}"]
    return [template.render([*pair.prompt, *answer]) for answer in (pair.chosen, pair.rejected)]  # type: ignore[list-item]


class PreferencePairs(Dataset):
    """Tokenized pairs, each sequence (prompt + completion) cut to `context` + 1 ids. Item i is (chosen
    inputs, chosen targets, rejected inputs, rejected targets, index): targets are the inputs shifted by
    one, IGNORE where the next id is the prompt's; `index` is the pair's place among all the task's pairs
    (`offset` + i), which keys precomputed reference log-probabilities. A pair whose prompt leaves no
    completion id within the context is left out (TRL drops those too)."""

    def __init__(self, encoded: Sequence[EncodedPair], context: int, offset: int = 0) -> None:
        """Hold the pairs of `encoded` that keep a completion id within `context`."""
        width = context + 1
        self.pairs = [p for p in encoded if len(p[0]) < width]
        #: pairs left out (their prompt fills the context), and pairs whose completions were cut
        self.dropped = len(encoded) - len(self.pairs)
        self.cut = sum(len(h) + max(len(c), len(r)) > width for h, c, r in self.pairs)
        self.width, self.offset = width, offset

    def __len__(self) -> int:
        return len(self.pairs)

    def _row(self, head: list[int], completion: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([*head, *completion][: self.width], dtype=torch.long)
        targets = ids[1:].clone()
        targets[: len(head) - 1] = IGNORE
        return ids[:-1], targets

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        head, chosen, rejected = self.pairs[i]
        return (*self._row(head, chosen), *self._row(head, rejected), torch.tensor(self.offset + i))


def collate_pairs(items: list[tuple[torch.Tensor, ...]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """A batch of B pairs as one concatenated batch: (tokens (2B, L), targets (2B, L), index (B,)), the
    chosen rows first, then the rejected ones in the same order, each padded on the right to the longest
    (`pad_id`, targets IGNORE): one forward serves both."""
    rows = [it[0] for it in items] + [it[2] for it in items]
    wanted = [it[1] for it in items] + [it[3] for it in items]
    length = max(len(r) for r in rows)
    tokens = torch.full((len(rows), length), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for j, (r, y) in enumerate(zip(rows, wanted, strict=True)):
        tokens[j, : len(r)], targets[j, : len(y)] = r, y
    return tokens, targets, torch.stack([it[4] for it in items])


def pair_collate(pad_id: int) -> Any:
    """`collate_pairs` with the tokenizer's padding id (a picklable function for loader workers)."""
    return functools.partial(collate_pairs, pad_id=pad_id)
