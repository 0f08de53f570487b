"""Chat conversations as token shards: `python -m recipes.prepare +task=sft` writes them, `+task=sft
data=tokens data.path=SHARDS` trains from them.

The folder is a token-shard folder of `text.token_shards` (the lm task's format): per split the conversations'
ids back to back, each conversation one document (its ids as the chat template renders and the tokenizer
encodes them, `text.chat.encode_conversation`), with beside each `SPLIT-NNNNN.bin` a `SPLIT_mask-NNNNN.bin`
of one uint8 per token, 1 where the loss is (the assistant's tokens), cut at the same places. The manifest
adds a `chat` entry: the template's SHA-256, the mask shards, the commonest training answer (the
`majority_baseline` of exact-match evaluation) and `val.jsonl`, the validation conversations as messages,
which exact-match evaluation asks from.

A run maps the shards and reads one packed row at a time (`text.sft.PackedConversations` over
`ConversationShards`): what it holds per conversation is its start offset (8 bytes) and per row its first
conversation, not the tokens.
"""

from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from core.data.prepared import prepare_folder
from core.errors import ConfigError, DataError
from core.files import write_text_atomic
from text.chat import ChatCorpus, ChatTemplate, Conversation, encode_conversation, read_conversations
from text.token_shards import (
    FORMAT,
    SPLITS,
    Shard,
    ShardSet,
    ShardWriter,
    TokenSplit,
    shard_files,
    token_dtype,
)
from text.tokenizer import Tokenizer, tokenizer_hash

#: the validation conversations, as messages, in a prepared chat folder
VAL_FILE = "val.jsonl"


class ConversationShards:
    """A split of prepared chat shards as the conversations `text.sft.PackedConversations` packs: each one's
    length up front, its ids and loss mask read from the memory maps when asked."""

    def __init__(self, tokens: TokenSplit, mask: TokenSplit) -> None:
        """The conversations of the split's `tokens` and loss `mask` streams (cut at the same places)."""
        self.tokens, self.mask = tokens, mask
        starts = [np.load(tokens.root / Path(s.file).with_suffix(".idx.npy")) for s in tokens.shards]
        self.starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        #: each conversation's number of ids
        self.lengths = np.diff(np.append(self.starts, tokens.tokens))
        if not len(self.starts):
            raise DataError(f"{tokens.root} holds no {tokens.name} conversations")

    def read(self, n: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, loss mask) of conversation `n`, cut to `width`."""
        a = int(self.starts[n])
        b = a + min(int(self.lengths[n]), width)
        return self.tokens.read(a, b), self.mask.read(a, b).astype(bool)


def mask_split(shards: ShardSet, split: str) -> TokenSplit:
    """The loss-mask stream of `split` of a prepared chat folder, checked against its manifest."""
    chat = shards.manifest["chat"]
    entries = chat["mask_splits"][split]["shards"]
    size = int(shards.manifest["shard_tokens"])
    out = TokenSplit(shards.root, f"{split}_mask", [Shard(**s) for s in entries], np.dtype("u1"), size)
    out.check()
    return out


def chat_manifest(shards: ShardSet, key: str = "data.path") -> dict[str, Any]:
    """The `chat` entry of a prepared folder; one written for the lm task is a one-line DataError."""
    chat = shards.manifest.get("chat")
    if not isinstance(chat, dict):
        raise DataError(
            f"{shards.root} holds documents prepared for +task=lm, not conversations; prepare it with "
            "python -m recipes.prepare +task=sft",
            key=key,
            value=str(shards.root),
            valid=("a folder prepared with +task=sft",),
        )
    return chat


def check_template(shards: ShardSet, template: ChatTemplate) -> None:
    """The run's chat template must be the one the conversations were rendered with."""
    want = chat_manifest(shards)["template_sha256"]
    if _sha(template.source) != want:
        raise ConfigError(
            f"the run's chat template ({template.origin}) is not the one {shards.root} was prepared with; "
            "set the tokenizer and model.weights it was prepared with, or prepare again",
            key="tokenizer",
            value=template.origin,
        )


def val_conversations(shards: ShardSet) -> list[Conversation]:
    """The validation conversations of a prepared chat folder, as messages."""
    return read_conversations(shards.root / chat_manifest(shards)["val_file"])


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def prepare_chat(
    corpus: ChatCorpus,
    out: str,
    *,
    template: ChatTemplate,
    tok: Tokenizer,
    tokenizer: dict[str, Any],
    shard_tokens: int = 1 << 26,
) -> dict[str, Any]:
    """Write `corpus`'s conversations, rendered by `template` and tokenized by `tok` (`tokenizer`: the
    manifest's description of it), as chat token shards in `out`; the manifest, with `"status"`."""
    inputs = {
        "conversations": _sha(json.dumps([corpus.train, corpus.val], sort_keys=True)),
        "tokenizer": tokenizer_hash(tok),
        "template": _sha(template.source),
        "shard_tokens": shard_tokens,
    }

    def build(dest: Path, fingerprint: str) -> dict[str, Any]:
        return _write_chat(dest, fingerprint, corpus, template, tok, tokenizer, shard_tokens)

    return prepare_folder(
        out,
        inputs,
        finished=_finished_chat,
        build=build,
        outputs=("*.bin", "*.idx.npy"),
        listed=lambda m: shard_files(m["splits"]) | shard_files(m["chat"]["mask_splits"]),
    )


def _finished_chat(dest: Path) -> dict[str, Any] | None:
    """The manifest of a whole prepared chat folder (None: one prepared for the lm task)."""
    manifest = ShardSet(dest).manifest
    return manifest if "chat" in manifest else None


def _write_chat(
    dest: Path,
    fingerprint: str,
    corpus: ChatCorpus,
    template: ChatTemplate,
    tok: Tokenizer,
    tokenizer: dict[str, Any],
    shard_tokens: int,
) -> dict[str, Any]:
    """Write the conversations' token and loss-mask shards and `VAL_FILE` into `dest`; the manifest."""
    dtype = token_dtype(tok.vocab_size)
    splits, masks, assistant = {}, {}, {}
    for split, convs in zip(SPLITS, (corpus.train, corpus.val), strict=True):
        splits[split], masks[split], assistant[split] = _write_split(
            dest, split, convs, template, tok, dtype, shard_tokens
        )
    answers = collections.Counter(
        [m["content"] for m in c if m["role"] == "assistant"][-1].strip() for c in corpus.train
    )
    write_text_atomic(dest / VAL_FILE, "".join(json.dumps({"messages": m}) + "\n" for m in corpus.val))
    return {
        "format": FORMAT,
        "inputs_sha256": fingerprint,
        "tokenizer": {
            "hash": tokenizer_hash(tok),
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            **tokenizer,
        },
        "dtype": dtype.str,
        "shard_tokens": shard_tokens,
        "splits": splits,
        "chat": {
            "template_sha256": _sha(template.source),
            "template_origin": template.origin,
            "mask_splits": masks,
            "assistant_tokens": assistant,
            "majority_answer": answers.most_common(1)[0][0] if answers else "",
            "val_file": VAL_FILE,
        },
    }


def _write_split(
    dest: Path,
    split: str,
    convs: list[Conversation],
    template: ChatTemplate,
    tok: Tokenizer,
    dtype: np.dtype,
    shard_tokens: int,
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """One split's conversations into token and mask shards: (its splits entry, its mask entry, its
    assistant tokens)."""
    writer = ShardWriter(dest, split, dtype, shard_tokens)
    mask_writer = ShardWriter(dest, f"{split}_mask", np.dtype("u1"), shard_tokens)
    assistant = 0
    for messages in convs:
        ids, mask = encode_conversation(messages, template, tok)
        lengths = np.array([len(ids)], dtype=np.int64)
        writer.add(np.asarray(ids, dtype=dtype), lengths)
        mask_writer.add(np.asarray(mask, dtype=np.uint8), lengths)
        assistant += sum(mask)
    shards = writer.close()
    entry = {"tokens": writer.written, "documents": writer.documents, "shards": shards}
    return entry, {"shards": mask_writer.close()}, assistant
