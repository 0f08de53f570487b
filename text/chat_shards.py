"""Chat conversations as token shards: `python -m recipes.prepare +task=sft` writes them, `+task=sft
data=tokens data.path=SHARDS` trains from them.

The folder is a token-shard folder of `text.token_shards` (the lm task's format): per split the conversations'
ids back to back, each conversation one document (its ids as the chat template renders and the tokenizer
encodes them, `text.chat.encode_conversation`), with beside each `SPLIT-NNNNN.bin` a `SPLIT_mask-NNNNN.bin`
of one uint8 per token, 1 where the loss is (the assistant's tokens), cut at the same places. The manifest
adds a `chat` entry: the template's SHA-256, the mask shards, the commonest training answer (the
`majority_baseline` of exact-match evaluation) and `val.jsonl`, the validation conversations as messages,
which exact-match evaluation asks from.

A run maps the shards and reads one packed row at a time (`PackedConversationShards`): what it holds per
conversation is its start offset (8 bytes) and per row its first conversation, not the tokens.
"""

from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from core.errors import ConfigError, DataError
from core.files import fsync, locked, write_text_atomic
from text.chat import ChatCorpus, ChatTemplate, Conversation, encode_conversation, read_conversations
from text.token_shards import FORMAT, MANIFEST, SPLITS, Shard, ShardSet, TokenSplit, token_dtype
from text.tokenizer import Tokenizer, tokenizer_hash

#: the validation conversations, as messages, in a prepared chat folder
VAL_FILE = "val.jsonl"


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


class PackedConversationShards(Dataset):
    """`text.sft.PackedConversations` over a split of prepared chat shards: the same rows, read when asked."""

    def __init__(self, tokens: TokenSplit, mask: TokenSplit, context: int, pad_id: int) -> None:
        """Rows of `context` + 1 tokens of the split's conversations (`tokens`, loss `mask` alike cut)."""
        self.tokens, self.mask, self.context, self.pad_id = tokens, mask, context, pad_id
        width = context + 1
        starts = [np.load(tokens.root / Path(s.file).with_suffix(".idx.npy")) for s in tokens.shards]
        self.starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self.lengths = np.diff(np.append(self.starts, tokens.tokens))
        if not len(self.starts):
            raise DataError(f"{tokens.root} holds no {tokens.name} conversations")
        self.firsts = row_starts(self.lengths, width)
        self.cut = int((self.lengths > width).sum())

    def __len__(self) -> int:
        return len(self.firsts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from text.lm_data import IGNORE

        width = self.context + 1
        last = self.firsts[i + 1] if i + 1 < len(self.firsts) else len(self.starts)
        parts = []
        for n in range(int(self.firsts[i]), int(last)):
            a = int(self.starts[n])
            b = a + min(int(self.lengths[n]), width)
            parts.append((n, self.tokens.read(a, b), self.mask.read(a, b).astype(bool)))
        t, k, d = pack_row(parts, width, self.pad_id, len(self.starts))
        y = t[1:].masked_fill(~k[1:] | (d[1:] != d[:-1]), IGNORE)
        return t[:-1], y, d[:-1]


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
    from text.prepare import ShardWriter

    dest = Path(out).expanduser()
    thash = tokenizer_hash(tok)
    inputs = {
        "conversations": _sha(json.dumps([corpus.train, corpus.val], sort_keys=True)),
        "tokenizer": thash,
        "template": _sha(template.source),
        "shard_tokens": shard_tokens,
    }
    fingerprint = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    dest.mkdir(parents=True, exist_ok=True)
    with locked(dest / ".prepare.lock"):
        try:
            done = ShardSet(dest)
            if done.manifest.get("inputs_sha256") == fingerprint and "chat" in done.manifest:
                return {**done.manifest, "status": "up to date"}
        except DataError:
            pass
        (dest / MANIFEST).unlink(missing_ok=True)
        dtype = token_dtype(tok.vocab_size)
        splits, masks, assistant = {}, {}, {}
        for split, convs in zip(SPLITS, (corpus.train, corpus.val), strict=True):
            writer = ShardWriter(dest, split, dtype, shard_tokens)
            mask_writer = ShardWriter(dest, f"{split}_mask", np.dtype("u1"), shard_tokens)
            assistant[split] = 0
            for messages in convs:
                ids, mask = encode_conversation(messages, template, tok)
                lengths = np.array([len(ids)], dtype=np.int64)
                writer.add(np.asarray(ids, dtype=dtype), lengths)
                mask_writer.add(np.asarray(mask, dtype=np.uint8), lengths)
                assistant[split] += sum(mask)
            shards = writer.close()
            splits[split] = {"tokens": writer.written, "documents": writer.documents, "shards": shards}
            masks[split] = {"shards": mask_writer.close()}
        answers = collections.Counter(
            [m["content"] for m in c if m["role"] == "assistant"][-1].strip() for c in corpus.train
        )
        write_text_atomic(dest / VAL_FILE, "".join(json.dumps({"messages": m}) + "\n" for m in corpus.val))
        manifest = {
            "format": FORMAT,
            "inputs_sha256": fingerprint,
            "tokenizer": {"hash": thash, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, **tokenizer},
            "dtype": dtype.str,
            "shard_tokens": shard_tokens,
            "splits": splits,
            "chat": {
                "template_sha256": inputs["template"],
                "template_origin": template.origin,
                "mask_splits": masks,
                "assistant_tokens": assistant,
                "majority_answer": answers.most_common(1)[0][0] if answers else "",
                "val_file": VAL_FILE,
            },
        }
        fsync(dest)
        write_text_atomic(dest / MANIFEST, json.dumps(manifest, indent=1))
        keep = {e["file"] for group in (splits, masks) for v in group.values() for e in v["shards"]}
        for stale in dest.glob("*.bin"):  # a former prepare's shards this manifest does not list
            if stale.name not in keep:
                stale.unlink(missing_ok=True)
                stale.with_suffix(".idx.npy").unlink(missing_ok=True)
        return {**manifest, "status": "prepared"}
