"""Prompts for the tasks that sample their own completions (`+task=grpo`, on-policy distillation): the
`data=prompts` JSONL reader and its embedded tasks, the `data=toy_chat` conversations a model learns those
tasks' format from, and prompts tokenized into batches of `PromptRow`s.

A prompt row is `{"prompt": text or [{"role", "content"}, ...], ...fields}` in TRL's two forms: a message
list is rendered with the chat template and its generation prompt (conversational); a text is continued as
it is, after the id documents start with (standard: no template, as TRL and +task=dpo's text pairs take
it), for a base model. Every other key is a field passed to the reward functions (for example `answer`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from torch.utils.data import Dataset

from core.bounds import Bounds
from core.data.bad_samples import DEFAULT_POLICY, BadSamplePolicy
from core.errors import DataError
from core.logging.messages import warn
from core.registry import DATASETS
from text.chat import (
    ROLES,
    ChatCorpus,
    ChatTemplate,
    Conversation,
    kjv_questions,
    prompt_ids,
    read_rows,
    split_examples,
)
from text.corpus import in_validation
from text.rewards import RESERVED, Completion, completion_text
from text.tokenizer import Tokenizer


@dataclass
class PromptCorpus:
    """Training and validation prompts: JSONL rows, each a `prompt` and fields for the rewards."""

    train: list[dict[str, Any]]
    val: list[dict[str, Any]]


@dataclass
class PromptRow:
    """One prompt as a batch holds it: its index in its split, the row as written and its ids."""

    index: int
    prompt: str | Conversation
    fields: dict[str, Any]
    ids: list[int]


def prompt_fault(row: Any) -> str | None:
    """Why a JSONL row is not a prompt (None: it is one), naming the key at fault."""
    prompt = row.get("prompt") if isinstance(row, dict) else None
    taken = [k for k in RESERVED if isinstance(row, dict) and k in row]
    if taken:
        return f"a field named '{taken[0]}' (the rewards are called with {', '.join(RESERVED)}): rename it"
    if isinstance(prompt, str) and prompt:
        return None
    if not isinstance(prompt, list) or not prompt:
        return "no 'prompt' (a text or a list of messages)"
    for j, m in enumerate(prompt):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            return f"prompt[{j}] is not a message (role, content)"
    return None


def toy_rows(kind: str, count: int, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """(key, row) of the embedded tasks, generated here, each prompt one user message (a chat model's
    task): `reverse` ("Reverse abc" -> "cba", three letters of a-h), `add` ("3+5=" -> "8") or `kjv`
    (which of five books holds a verse)."""
    if kind == "kjv":
        return [
            (ref, {"prompt": m[:1], "answer": m[1]["content"]})
            for ref, m in kjv_questions(per_book=count // 5 or 1, max_chars=150, seed=seed)
        ]
    if kind == "add":
        asked = [(f"{a}+{b}", f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
    else:
        letters = "abcdefgh"
        words = [a + b + c for a in letters for b in letters for c in letters]
        random.Random(seed).shuffle(words)
        asked = [(w, f"Reverse {w}", w[::-1]) for w in words[:count]]
    return [(key, {"prompt": [{"role": "user", "content": q}], "answer": a}) for key, q, a in asked]


def letters_in_place(
    prompts: Sequence[Any], completions: Sequence[Completion], *, answer: Sequence[str], **fields: Any
) -> list[float]:
    """A reward for the embedded tasks, named as a user's is (`task.rewards=[text.prompts:letters_in_place]`):
    the share of the answer's characters a completion (stripped) has in their place, a denser signal than
    exact match for a model that gets a letter or two right."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        c, a = completion_text(c).strip(), str(a)
        out.append(sum(x == y for x, y in zip(c, a, strict=False)) / max(len(a), len(c), 1))
    return out


@DATASETS.register("prompts")
def prompts(
    *,
    train: str = "",
    val: str = "",
    val_fraction: Annotated[float, Bounds(gt=0, lt=1)] = 0.1,
    embedded: Annotated[str, Bounds(choices=("reverse", "add", "kjv"))] = "reverse",
    count: Annotated[int, Bounds(ge=10)] = 512,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> PromptCorpus:
    """Prompts for +task=grpo: JSONL files of {"prompt": text or [{"role", "content"}, ...], ...fields}, or
    with no `train` an embedded task (`toy_rows`), split by a hash of each item.

    train: the training prompts, .jsonl (empty: the embedded task)
    val: the validation prompts, .jsonl (empty: the last val_fraction of train's, in file order)
    val_fraction: the share held out for validation when no `val` file is given
    embedded: the embedded task: reverse (three letters), add (two digits) or kjv (which book)
    count: the embedded task's items at most (kjv: verses, a fifth per book)
    """
    train_rows, val_rows = split_examples(
        train,
        val,
        val_fraction,
        lambda: toy_rows(embedded, count),
        lambda path: read_rows(path, policy, prompt_fault, '{"prompt": ...}', "prompts"),
    )
    return PromptCorpus(train_rows, val_rows)


@DATASETS.register("toy_chat")
def toy_chat(
    *,
    embedded: Annotated[str, Bounds(choices=("reverse", "add", "kjv"))] = "reverse",
    count: Annotated[int, Bounds(ge=10)] = 512,
    val_fraction: Annotated[float, Bounds(gt=0, lt=1)] = 0.1,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> ChatCorpus:
    """The embedded prompts of data=prompts answered, as conversations for +task=sft: the short SFT a
    model learns the task's format from before +task=grpo.

    embedded: the embedded task: reverse (three letters), add (two digits) or kjv (which book)
    count: the task's items at most
    val_fraction: the share held out for validation (the same items as data=prompts holds out)
    policy: unused (generated data has no bad samples); every data option carries the keys
    """
    convs: tuple[list[Conversation], list[Conversation]] = ([], [])
    for key, row in toy_rows(embedded, count):
        convs[in_validation(key, val_fraction)].append(
            [*row["prompt"], {"role": "assistant", "content": row["answer"]}]
        )
    return ChatCorpus(*convs)


def prompt_text(prompt: str | Conversation, template: ChatTemplate) -> str:
    """The text a prompt is given to the model as: a text as it is, messages rendered with `template`'s
    generation prompt (what a bpe tokenizer learns from)."""
    return prompt if isinstance(prompt, str) else template.render(prompt, add_generation_prompt=True)


def encode_prompt(prompt: str | Conversation, template: ChatTemplate, tokenizer: Tokenizer) -> list[int]:
    """The ids a model continues from: a text after the id documents start with (TRL's standard form, as
    +task=dpo's text pairs), messages as +task=sft tokenizes them, then the generation prompt."""
    if isinstance(prompt, str):
        return [tokenizer.doc_start_id, *tokenizer.encode(prompt)]
    return prompt_ids(prompt, template, tokenizer)


class PromptSet(Dataset):
    """Prompt rows tokenized with the chat template's generation prompt; item i is its `PromptRow`."""

    def __init__(self, rows: Sequence[PromptRow]) -> None:
        """Hold `rows`."""
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptRow:
        return self.rows[i]


def collate_prompts(rows: list[PromptRow]) -> dict[str, Any]:
    """A batch of prompts: their indices (the batch's size) and rows."""
    return {"index": torch.tensor([r.index for r in rows], dtype=torch.long), "rows": rows}


def tokenize_prompts(
    rows: Sequence[dict[str, Any]],
    template: ChatTemplate,
    tokenizer: Tokenizer,
    *,
    context: int,
    max_new_tokens: int,
    split: str,
) -> PromptSet:
    """`rows` tokenized with the template's generation prompt; a prompt leaving no room for
    `max_new_tokens` in `context` is skipped with a warning; none left: one line naming task.context."""
    budget, out, skipped = context - max_new_tokens, [], 0
    for row in rows:
        ids = encode_prompt(row["prompt"], template, tokenizer)
        if len(ids) > budget:
            skipped += 1
            continue
        fields = {k: v for k, v in row.items() if k != "prompt"}
        out.append(PromptRow(len(out), row["prompt"], fields, ids))
    if skipped:
        warn(
            f"{skipped} {split} prompt(s) longer than task.context - task.max_new_tokens = {budget} "
            "tokens were skipped"
        )
    if not out:
        raise DataError(
            f"no {split} prompt fits task.context - task.max_new_tokens = {budget} tokens; raise "
            "task.context",
            key="task.context",
            value=str(context),
        )
    return PromptSet(out)
