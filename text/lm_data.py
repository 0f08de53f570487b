"""Language-model data: corpora registered as datasets (documents in memory, or token shards prepared on
disk), and the window datasets the `lm` task trains on (packed chunks, memory-mapped windows, mixtures)."""

from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
from torch.utils.data import Dataset

from core.bounds import Bounds
from core.data.bad_samples import DEFAULT_POLICY, BadSamplePolicy
from core.errors import ConfigError, DataError
from core.registry import DATASETS
from text.corpus import kjv_books, read_text_documents, split_tail
from text.token_shards import ShardSet, TokenSplit
from text.tokenizer import BPETokenizer, Tokenizer, TokenizerSpec, tokenizer_hash

IGNORE = -100  # cross_entropy's ignore_index: targets that would cross into the next document


class LMData:
    """What an lm data builder returns: documents in memory (TextCorpus) or prepared shards (TokenCorpus)."""


@dataclass
class TextCorpus(LMData):
    """Training and validation documents (each a string)."""

    train: list[str]
    val: list[str]


def _split_documents(docs: list[str], val_fraction: float) -> TextCorpus:
    pairs = [split_tail(d, val_fraction) for d in docs]
    return TextCorpus([h for h, _ in pairs if h], [t for _, t in pairs if t])


@DATASETS.register("kjv")
def kjv(
    *, val_fraction: Annotated[float, Bounds(gt=0, lt=1)] = 0.1, policy: BadSamplePolicy = DEFAULT_POLICY
) -> TextCorpus:
    """The embedded King James Bible, one document per book; the last `val_fraction` of each validates.

    val_fraction: the tail of each book held out for validation, as a fraction
    policy: accepted like every data section's, with nothing to skip in the checked-in text
    """
    return _split_documents(kjv_books(), val_fraction)


@DATASETS.register("text_files")
def text_files(
    *,
    root: Annotated[str, Bounds(exists="dir")] = "",
    val_fraction: Annotated[float, Bounds(gt=0, lt=1)] = 0.1,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> TextCorpus:
    """Every .txt/.text/.md file under `root` as a document; the last `val_fraction` of each validates.

    root: the folder searched for text files (required)
    val_fraction: the tail of each document held out for validation, as a fraction
    """
    return _split_documents(read_text_documents(root, policy), val_fraction)


@dataclass
class TokenCorpus(LMData):
    """Prepared token shards (`python -m recipes.prepare`): training and validation splits, memory-mapped;
    several sources (`data.sources`) each with the share of the training tokens it is to give."""

    shards: ShardSet  # the first source's, whose tokenizer every source shares
    train: list[TokenSplit]
    val: list[TokenSplit]
    weights: list[float] = field(default_factory=lambda: [1.0])
    names: list[str] = field(default_factory=list)

    def tokenizer(self, spec: TokenizerSpec) -> Tokenizer:
        """The run's tokenizer (bpe: the one the shards were prepared with), checked against the manifest's
        hash; a mismatch is a one-line ConfigError naming `tokenizer`."""
        prepared = self.shards.tokenizer
        tok: Tokenizer | None = None
        if spec.name == prepared["name"] == "bpe":
            if spec.bpe_vocab_size != prepared.get("bpe_vocab_size"):
                raise ConfigError(
                    f"task.bpe_vocab_size={spec.bpe_vocab_size}, but {self.shards.root} was prepared with "
                    f"{prepared.get('bpe_vocab_size')}; set it so, or prepare again",
                    key="task.bpe_vocab_size",
                    value=str(spec.bpe_vocab_size),
                    valid=(str(prepared.get("bpe_vocab_size")),),
                )
            import tokenizers

            tok = BPETokenizer(tokenizers.Tokenizer.from_file(str(self.shards.root / "tokenizer.json")))
        elif spec.name == prepared["name"]:
            tok = spec.fit([])  # bytes and pretrained learn nothing from the texts
        if tok is None or tokenizer_hash(tok) != prepared["hash"]:
            raise ConfigError(
                f"tokenizer={spec.name} is not the tokenizer {self.shards.root} was prepared with "
                f"({prepared['name']}, hash {prepared['hash'][:12]}); set tokenizer={prepared['name']} "
                "(and its settings) or prepare the data again with this one",
                key="tokenizer",
                value=spec.name,
                valid=(prepared["name"],),
            )
        return tok


@DATASETS.register("tokens")
def tokens(
    *,
    path: Annotated[str, Bounds(exists="dir")] = "",
    val_path: Annotated[str, Bounds(exists="dir")] = "",
    sources: list[Any] = (),
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> TokenCorpus:
    """Token shards written by `python -m recipes.prepare`, read by memory map; its held-out documents
    validate, or those of another prepared folder.

    path: the prepared folder (its manifest.json); or give sources
    val_path: a prepared folder whose training split validates instead (e.g. one prepared with
        data.val_fraction=0 from separate files); empty: the held-out documents of path (or of every source)
    sources: a mixture, [{path: DIR, weight: W}, ...]: each prepared folder gives W / sum(W) of the training
        tokens (data=tokens alone: path)
    policy: accepted like every data section's; prepare counted and dropped the bad documents
    """
    entries = _mixture(path, list(sources))
    sets = [ShardSet(p) for p, _ in entries]
    for (p, _), other in zip(entries[1:], sets[1:], strict=True):
        if other.tokenizer["hash"] != sets[0].tokenizer["hash"]:
            raise ConfigError(
                f"{p} was prepared with another tokenizer than {entries[0][0]}; prepare every source with "
                "one tokenizer",
                key="data.sources",
                value=str(p),
            )
    val = [s.val for s in sets]
    if val_path:
        other = ShardSet(val_path)
        if other.tokenizer["hash"] != sets[0].tokenizer["hash"]:
            raise ConfigError(
                f"data.val_path={val_path} was prepared with another tokenizer than {entries[0][0]}",
                key="data.val_path",
                value=str(val_path),
            )
        val = [other.train]
    if not sum(v.tokens for v in val):
        raise DataError(
            f"{entries[0][0]} holds no validation documents; prepare it with a larger data.val_fraction, or "
            "set data.val_path",
            key="data.val_path",
            value=str(val_path),
        )
    total = sum(w for _, w in entries)
    names = [re.sub(r"[^\w.-]", "_", Path(p).name) or str(i) for i, (p, _) in enumerate(entries)]
    if len(set(names)) < len(names):
        names = [f"{i}_{n}" for i, n in enumerate(names)]
    return TokenCorpus(sets[0], [s.train for s in sets], val, [w / total for _, w in entries], names)


def _mixture(path: str, sources: list[Any]) -> list[tuple[str, float]]:
    """(folder, weight) of data.path or of each data.sources entry, checked: one line naming the entry."""
    if path and sources:
        raise ConfigError(
            "give data.path or data.sources, not both", key="data.sources", value=str(sources), valid=("[]",)
        )
    if not path and not sources:
        raise ConfigError(
            "data=tokens reads a prepared folder; set data.path=DIR (python -m recipes.prepare +task=lm "
            "data.root=TEXT out=DIR writes one) or data.sources=[{path: DIR, weight: W}, ...]",
            key="data.path",
            value="",
            valid=("a prepared folder",),
        )
    if path:
        return [(path, 1.0)]
    out = []
    for i, entry in enumerate(sources):
        key = f"data.sources[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"path", "weight"} or "path" not in entry:
            raise ConfigError(
                f"{key}={entry} must be {{path: DIR, weight: W}}",
                key=key,
                value=str(entry),
                valid=("path", "weight"),
            )
        weight = entry.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not weight > 0:
            raise ConfigError(
                f"{key}.weight={weight} must be > 0", key=f"{key}.weight", value=str(weight), valid=("> 0",)
            )
        if not Path(str(entry["path"])).expanduser().is_dir():
            raise ConfigError(
                f"{key}.path={entry['path']} does not exist; give a folder python -m recipes.prepare wrote",
                key=f"{key}.path",
                value=str(entry["path"]),
                valid=("an existing folder",),
            )
        out.append((str(entry["path"]), float(weight)))
    return out


class TokenWindows(Dataset):
    """`PackedChunks` over a memory-mapped split of token shards: item i is (inputs, targets, doc_ids) over
    stream tokens [i*context, (i+1)*context], read when asked, with the same values PackedChunks gives for
    the same documents."""

    def __init__(self, split: TokenSplit, context: int, max_chunks: int = 0) -> None:
        """Windows of `context` (+1) tokens of `split`; keep `max_chunks` evenly spaced ones when > 0."""
        self.split, self.context = split, context
        self.n = (split.tokens - 1) // context
        if self.n < 1:
            raise DataError(
                f"the {split.name} split of {split.root} holds {split.tokens} tokens, fewer than "
                f"task.context+1={context + 1}"
            )
        # only a validation subset is listed: a training split's window starts are computed, never stored
        self.picked = (
            torch.linspace(0, self.n - 1, max_chunks).round().long().tolist()
            if 0 < max_chunks < self.n
            else None
        )

    def __len__(self) -> int:
        return len(self.picked) if self.picked is not None else self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i = self.picked[i] if self.picked is not None else i % self.n
        s, c = i * self.context, self.context
        tokens = torch.from_numpy(self.split.read(s, s + c + 1))
        docs = torch.from_numpy(self.split.doc_ids(s, s + c + 1))
        x, d = tokens[:c], docs[:c]
        return x, tokens[1:].masked_fill(docs[1:] != d, IGNORE), d


class MixedWindows(Dataset):
    """Windows of several sources mixed by their share of the tokens (all windows hold context+1 tokens, so
    a share of windows is a share of tokens), each item tagged with its source's index.

    An epoch holds as many windows as the sources together, N; source s fills round(w_s N) of them (largest
    remainders), its k-th taking window k of it when it is up-weighted past its size (cycling). When it is
    down-weighted to c of its n windows, its k-th slot stands for the stratum [k n / c, (k+1) n / c) of its
    windows and takes one of them drawn from torch's generator, which the training loader seeds per sample
    from (seed, epoch, index) (`core.data.seeded`): each epoch reads other windows of the source, spread over
    all of it, and the draw stays a function of (seed, epoch), so resume, workers and ranks stay exact. The
    order, and with it the realised mix of every batch, is the sampler's."""

    def __init__(self, parts: list[TokenWindows], weights: list[float]) -> None:
        """Mix `parts` with target shares `weights` (summing to 1)."""
        self.parts = parts
        n = sum(len(p) for p in parts)
        raw = [w * n for w in weights]
        counts = [int(r) for r in raw]
        for j in sorted(range(len(raw)), key=lambda j: counts[j] - raw[j])[: n - sum(counts)]:
            counts[j] += 1
        self.counts = counts
        self.ends = list(itertools.accumulate(counts))

    def shares(self) -> list[float]:
        """Each source's share of an epoch's windows (and tokens)."""
        return [c / self.ends[-1] for c in self.counts]

    def __len__(self) -> int:
        return self.ends[-1]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        s = bisect.bisect_right(self.ends, i)
        k, c, n = i - (self.ends[s - 1] if s else 0), self.counts[s], len(self.parts[s])
        if c >= n:
            return (*self.parts[s][k % n], torch.tensor(s))
        lo, hi = k * n // c, (k + 1) * n // c
        with torch.random.fork_rng(
            devices=[]
        ):  # reads the per-sample seed; leaves the caller's stream as it was
            j = lo + int(torch.randint(hi - lo, ()))
        return (*self.parts[s][j], torch.tensor(s))


class PackedChunks(Dataset):
    """Documents tokenized, each as EOS + text + EOS, concatenated and cut into chunks of `context` tokens.

    The leading EOS lets the model learn how documents begin (generation from an empty prompt starts there);
    the trailing one teaches it where they end.

    Item i is (inputs, targets, doc_ids) over tokens [i*context, (i+1)*context]: targets are the inputs
    shifted by one, with IGNORE where the next token belongs to another document.
    """

    def __init__(
        self,
        docs: list[list[int]],
        context: int,
        eos_id: int,
        max_chunks: int = 0,
        start_id: int | None = None,
    ) -> None:
        """Pack `docs` (token id lists); keep `max_chunks` evenly spaced chunks when > 0. `start_id` leads
        each document instead of `eos_id` (a pretrained tokenizer's BOS: `Tokenizer.doc_start_id`)."""
        start = eos_id if start_id is None else start_id
        tokens = [t for d in docs for t in (start, *d, eos_id)]
        owner = [i for i, d in enumerate(docs) for _ in range(len(d) + 2)]
        self.tokens = torch.tensor(tokens, dtype=torch.long)
        self.doc_ids = torch.tensor(owner, dtype=torch.long)
        self.context = context
        n = (len(tokens) - 1) // context
        if n < 1:
            raise DataError(f"the text holds {len(tokens)} tokens, fewer than task.context+1={context + 1}")
        starts = torch.arange(n) * context
        if 0 < max_chunks < n:
            starts = starts[torch.linspace(0, n - 1, max_chunks).round().long()]
        self.starts = starts.tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, c = self.starts[i], self.context
        x, d = self.tokens[s : s + c], self.doc_ids[s : s + c]
        y = self.tokens[s + 1 : s + c + 1].masked_fill(self.doc_ids[s + 1 : s + c + 1] != d, IGNORE)
        return x, y, d
