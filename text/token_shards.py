"""Tokenized shards on disk: the format `python -m recipes.prepare` writes and `data=tokens` reads.

A prepared folder holds, per split (`train`, `val`), fixed-size shards of the split's packed token stream
(each document as EOS + tokens + EOS, documents back to back, exactly `text.lm_data.PackedChunks`' stream),
as raw little-endian uint16 (uint32 when the vocabulary needs it) that `np.memmap` maps without reading;
beside each `NAME.bin` a `NAME.idx.npy` with the stream offsets of the documents that start in it; and
`manifest.json`, written last, which names the tokenizer (and its hash), the shards with their sizes, and
the sources.

Nothing here reads a whole split: a window is read from the one or two shards it spans, and a document id
from a binary search in a shard's index, both memory-mapped, so a run's resident memory does not grow with
the corpus. `ShardWriter` writes one split's stream into such shards (the lm task's prepare and the chat
conversations' alike).
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.data.prepared import MANIFEST
from core.errors import DataError
from core.files import write_atomic

FORMAT = "torchkiln.tokens/1"
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (half the disk and page cache of uint32), else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


@dataclass(frozen=True)
class Shard:
    """One shard file of a split: its token count, and the documents that start in it."""

    file: str
    tokens: int
    first_doc: int
    documents: int


class TokenSplit:
    """One split's shards as one token stream, each shard memory-mapped on first use (per process)."""

    def __init__(
        self, root: Path, name: str, shards: list[Shard], dtype: np.dtype, shard_tokens: int
    ) -> None:
        """Shards of `root` in stream order; every shard but the last holds `shard_tokens` tokens."""
        self.root, self.name, self.shards, self.dtype = root, name, shards, dtype
        self.shard_tokens = shard_tokens
        self.tokens = sum(s.tokens for s in shards)
        self.documents = sum(s.documents for s in shards)
        self._maps: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __getstate__(self) -> dict[str, Any]:
        # a DataLoader worker maps the files itself: a pickled memmap would copy the whole shard
        return {**self.__dict__, "_maps": {}}

    def check(self) -> None:
        """Every shard and index present with the size the manifest gives, else a one-line DataError."""
        for s in self.shards:
            path = self.root / s.file
            want = s.tokens * self.dtype.itemsize
            size = path.stat().st_size if path.is_file() else None
            if size != want:
                why = "is missing" if size is None else f"holds {size} bytes where the manifest says {want}"
                raise DataError(
                    f"{path} {why}; prepare the folder again (python -m recipes.prepare ... out={self.root})",
                    key="shard",
                    value=str(path),
                )
            index = path.with_suffix(".idx.npy")
            try:
                n = len(np.load(index, mmap_mode="r"))
            except (OSError, ValueError) as e:
                n = f"unreadable ({type(e).__name__})"
            if n != s.documents:
                raise DataError(
                    f"{index}: {n} document offsets where the manifest says {s.documents}; prepare the folder"
                    f" again (python -m recipes.prepare ... out={self.root})",
                    key="shard",
                    value=str(index),
                )

    def _map(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        if k not in self._maps:
            path = self.root / self.shards[k].file
            n = self.shards[k].tokens
            if n == 0:
                tokens = np.zeros(0, self.dtype)
            else:
                with path.open("rb") as f:  # the mapping outlives the descriptor
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
                    # windows are read in a shuffled order: without this, each page fault reads ahead
                    # around the window, and the mapped pages (and the bytes read) grow with the corpus
                    # instead of with the batches read (BENCHMARKS.md § Data larger than memory)
                    mapped.madvise(mmap.MADV_RANDOM)
                tokens = np.frombuffer(mapped, dtype=self.dtype, count=n)
            self._maps[k] = (tokens, np.load(path.with_suffix(".idx.npy"), mmap_mode="r"))
        return self._maps[k]

    def _spans(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """(shard, start, end) within each shard that stream positions [a, b) cover."""
        out, k = [], a // self.shard_tokens
        while a < b:
            end = min(b, (k + 1) * self.shard_tokens)
            out.append((k, a - k * self.shard_tokens, end - k * self.shard_tokens))
            a, k = end, k + 1
        return out

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens at stream positions [a, b), as int64."""
        return np.concatenate([self._map(k)[0][s:e].astype(np.int64) for k, s, e in self._spans(a, b)])

    def doc_ids(self, a: int, b: int) -> np.ndarray:
        """The split-wide index of the document holding each stream position in [a, b)."""
        parts = []
        for k, s, e in self._spans(a, b):
            starts = self._map(k)[1]
            pos = np.arange(s, e, dtype=np.int64) + k * self.shard_tokens
            # documents starting at or before each position in this shard; -1: one that began earlier
            parts.append(self.shards[k].first_doc + np.searchsorted(starts, pos, side="right") - 1)
        return np.concatenate(parts)


class ShardSet:
    """A prepared folder: its manifest and its splits."""

    def __init__(self, root: str | Path) -> None:
        """Read `root`/manifest.json and check every shard's size; a missing or corrupt one is a DataError."""
        self.root = Path(root).expanduser()
        path = self.root / MANIFEST
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
            if manifest.get("format") != FORMAT:
                raise ValueError(f"format {manifest.get('format')!r}")
            dtype = np.dtype(manifest["dtype"])
            splits = {
                name: TokenSplit(
                    self.root,
                    name,
                    [Shard(**s) for s in manifest["splits"][name]["shards"]],
                    dtype,
                    int(manifest["shard_tokens"]),
                )
                for name in SPLITS
            }
        except FileNotFoundError:
            raise DataError(
                f"{path} is missing: not a prepared folder, or its prepare did not finish; run python -m "
                f"recipes.prepare +task=lm data.root=DIR out={self.root}",
                key="data.path",
                value=str(self.root),
            ) from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"{path} is corrupt ({type(e).__name__}: {e}); prepare the folder again",
                key="manifest",
                value=str(path),
            ) from None
        self.manifest = manifest
        self.train, self.val = splits["train"], splits["val"]
        for split in splits.values():
            split.check()

    @property
    def tokenizer(self) -> dict[str, Any]:
        """The manifest's tokenizer entry: name, hash, vocab_size, eos_id (and bpe_vocab_size for bpe)."""
        return dict(self.manifest["tokenizer"])


# -- writing ---------------------------------------------------------------------------------------------


class ShardWriter:
    """Cuts one split's token stream into shards of `shard_tokens`, each written atomically."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        """Write `split`-NNNNN.bin and .idx.npy files into `out`."""
        self.out, self.split, self.dtype, self.size = out, split, dtype, shard_tokens
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.starts: list[np.ndarray] = []  # split-wide offsets of documents not yet in a written shard
        self.written = 0  # tokens in the shards written
        self.documents = 0
        self.shards: list[dict[str, int | str]] = []

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append one source's packed documents; write every shard that is now full."""
        if not len(lengths):
            return
        at = self.written + self.pending_tokens
        self.starts.append(at + np.concatenate([[0], np.cumsum(lengths[:-1])]))
        self.pending.append(tokens)
        self.pending_tokens += len(tokens)
        while self.pending_tokens >= self.size:
            self._flush(self.size)

    def close(self) -> list[dict[str, int | str]]:
        """Write the last (short) shard; the shards' manifest entries."""
        if self.pending_tokens:
            self._flush(self.pending_tokens)
        return self.shards

    def _flush(self, n: int) -> None:
        stream = np.concatenate(self.pending)
        head, rest = stream[:n], stream[n:]
        starts = np.concatenate(self.starts) if self.starts else np.zeros(0, np.int64)
        mine = starts[starts < self.written + n]
        self.starts = [starts[len(mine) :]]
        name = f"{self.split}-{len(self.shards):05d}"
        write_atomic(self.out / f"{name}.idx.npy", lambda f: np.save(f, mine.astype(np.int64)))
        write_atomic(self.out / f"{name}.bin", lambda f: f.write(head.astype(self.dtype).tobytes()))
        self.shards.append(
            {"file": f"{name}.bin", "tokens": n, "first_doc": self.documents, "documents": len(mine)}
        )
        self.documents += len(mine)
        self.written += n
        self.pending, self.pending_tokens = ([rest] if len(rest) else []), len(rest)


def shard_files(splits: dict[str, Any]) -> set[str]:
    """The file names of the token shards (.bin and .idx.npy) that the manifest entries `splits` list."""
    bins = [s["file"] for split in splits.values() for s in split["shards"]]
    return {*bins, *(str(Path(b).with_suffix(".idx.npy")) for b in bins)}
