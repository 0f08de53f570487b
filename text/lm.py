"""Language modelling: corpora registered as datasets, packed fixed-length chunks, and the `lm` task."""

from __future__ import annotations

import bisect
import functools
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import ConcatDataset, Dataset, Subset

from core.bounds import Bounds
from core.data.bad_samples import DEFAULT_POLICY, BadSamplePolicy
from core.data.samplers import PermutedBatchSampler, ResumableBatchSampler
from core.errors import ConfigError, DataError
from core.logging.messages import say
from core.loop.task import ExportInputs, StepOutput, Task, batch_dim
from core.registry import DATASETS, MODELS, TASKS
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


@TASKS.register("lm")
class LanguageModeling(Task):
    """Next-token prediction with a registered model over packed documents of a registered corpus."""

    primary_metric = "val/loss"
    throughput_unit = "tokens"
    data_type = LMData
    model_inputs = ("vocab_size", "context")
    maximize = False
    loader_workers = 0  # chunks are slices of one in-memory tensor: workers would only add copying

    def __init__(
        self,
        *,
        model: dict[str, Any],
        data: dict[str, Any],
        tokenizer: str = "bytes",
        bpe_vocab_size: Annotated[int, Bounds(ge=1)] = 2048,
        context: Annotated[int, Bounds(ge=1)] = 256,
        packing: bool = True,
        val_chunks: Annotated[int, Bounds(ge=0)] = 0,
    ) -> None:
        """`model`/`data` are config sections: a registered `name` plus that builder's keywords. Settings
        are checked here; the corpus is read (and a BPE vocabulary fitted) when first needed.

        tokenizer: bytes, bpe (learned on the training text), pretrained (the tokenizer.json of the
            model.weights folder) or torchtext (legacy stack only); tokenizer=NAME sets it too
        bpe_vocab_size: vocabulary size the bpe tokenizer learns
        context: tokens per training chunk, and the model's longest input
        packing: documents packed into a chunk attend only within themselves (positions restart at each)
        val_chunks: evaluate on this many evenly spaced validation chunks (0: all of them)
        """
        if context < 1:
            raise ConfigError(f"task.context={context} must be positive")
        folder = str(model.get("weights") or "") if tokenizer == "pretrained" else ""
        self.tokenizer_spec = TokenizerSpec(tokenizer, bpe_vocab_size, folder)
        self.data_cfg, self.model_cfg = dict(data), dict(model)
        DATASETS.check_section(self.data_cfg)
        self.context, self.packing, self.val_chunks = context, packing, val_chunks
        self.mixture: dict[str, float] = {}  # data.sources' names and target shares, once the data is built

    @functools.cached_property
    def corpus(self) -> LMData:
        """Training and validation documents (or prepared shards), read on first use."""
        corpus: LMData = DATASETS.build_section(self.data_cfg)
        if isinstance(corpus, TextCorpus) and not corpus.val:
            raise DataError("the corpus has no validation text; raise data.val_fraction or add text")
        return corpus

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer, fitted on the training documents on first use where it learns a vocabulary (that
        of the prepared shards, checked against their manifest, with data=tokens)."""
        if self.tokenizer_spec.name == "pretrained" and self.data_cfg.get("name") != "tokens":
            # the folder's tokenizer.json learns nothing from the text: generating from an HF folder reads
            # no corpus (prepared shards still check theirs against the manifest, below)
            return self.tokenizer_spec.fit([])
        if isinstance(self.corpus, TokenCorpus):
            return self.corpus.tokenizer(self.tokenizer_spec)
        return self.tokenizer_spec.fit(self.corpus.train)

    def build_model(self) -> nn.Module:
        """The configured model, sized for the tokenizer and context."""
        return MODELS.build_section(
            self.model_cfg, vocab_size=self.tokenizer.vocab_size, context=self.context
        )

    def loads_after_sharding(self) -> bool:
        """A model.weights folder is read after FSDP/TP sharded the model built on the meta device, each rank
        its own slices (`text.pretrained.load_sharded`)."""
        return bool(self.model_cfg.get("weights"))

    def load_after_sharding(self, model: nn.Module, device: torch.device) -> None:
        """Each rank's slices of the model.weights folder's tensors, into `model`'s shards on `device`."""
        from text.pretrained import load_sharded

        load_sharded(model, device)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """Packed chunks of the tokenized training and validation documents (windows of the shards)."""
        tok, c = self.tokenizer, self.context
        if isinstance(self.corpus, TokenCorpus):
            return self._token_datasets(self.corpus)
        start = tok.doc_start_id
        train = PackedChunks(tok.encode_batch(self.corpus.train), c, tok.eos_id, start_id=start)
        val = PackedChunks(
            tok.encode_batch(self.corpus.val), c, tok.eos_id, max_chunks=self.val_chunks, start_id=start
        )
        return train, val

    def _token_datasets(self, corpus: TokenCorpus) -> tuple[Dataset, Dataset]:
        """Windows of prepared shards; several sources mixed by their weights, their targets logged."""
        c = self.context
        if len(corpus.train) == 1:
            return TokenWindows(corpus.train[0], c), TokenWindows(corpus.val[0], c, self.val_chunks)
        mixed = MixedWindows([TokenWindows(t, c) for t in corpus.train], corpus.weights)
        self.mixture = dict(zip(corpus.names, corpus.weights, strict=True))
        say(
            "data.sources, share of the training tokens (target / one epoch's): "
            + ", ".join(
                f"{n} {w:.3f} / {r:.3f}"
                for n, w, r in zip(corpus.names, corpus.weights, mixed.shares(), strict=True)
            )
        )
        val: Dataset = ConcatDataset([TokenWindows(v, c) for v in corpus.val if v.tokens > c])
        if 0 < self.val_chunks < len(val):
            val = Subset(val, torch.linspace(0, len(val) - 1, self.val_chunks).round().long().tolist())
        return mixed, val

    def batch_sampler(
        self, dataset: Dataset, batch_size: int, *, train: bool, seed: int
    ) -> ResumableBatchSampler:
        """The shuffled batches every task has; over shards, an order computed batch by batch, which holds
        nothing per window (a corpus's windows number in the millions: a list of them per rank would not)."""
        if not isinstance(self.corpus, TokenCorpus):
            return super().batch_sampler(dataset, batch_size, train=train, seed=seed)
        return PermutedBatchSampler(len(dataset), batch_size, shuffle=train, seed=seed, drop_last=False)

    def step(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> StepOutput:
        """Mean next-token cross-entropy (nats per token) over the batch; with data.sources, each source's
        share of the batch's tokens beside its target (`share/NAME`, `share_target/NAME`)."""
        x, y, d = batch[:3]
        logits = model(x, d) if self.packing else model(x)
        # the mean over the targets kept, taken as sum / count so a batch (or a rank's share of one) whose
        # targets are all IGNOREd has a zero loss, not torch's empty-mean NaN that would skip the whole step
        kept = (y != IGNORE).sum().clamp(min=1)
        loss = (
            F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
            / kept
        )
        metrics: dict[str, float | torch.Tensor] = {}
        if len(batch) == 4:  # MixedWindows' source index per row
            counts = torch.bincount(batch[3], minlength=len(self.mixture)).float() / len(batch[3])
            for j, (name, target) in enumerate(self.mixture.items()):
                metrics[f"share/{name}"], metrics[f"share_target/{name}"] = counts[j], target
        return StepOutput(loss=loss, count=y.numel(), metrics=metrics)

    def throughput_units(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> float:
        """Input positions (ignored targets too: the model computes them all)."""
        return float(batch[0].numel())

    def loss_units(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> int:
        """The targets `step`'s cross-entropy averages over: those not IGNOREd (packing ignores the
        positions whose next token belongs to another document, so chunks hold different counts)."""
        return int((batch[1] != IGNORE).sum())

    def export_inputs(self, model: nn.Module, batch: Any, *, length: int | None = None) -> ExportInputs:
        """Token ids (B, L) in, next-token logits (B, L, V) out; any batch size and any length up to the
        context (the position table's size). Each row is one sequence from position 0, as `generate` feeds
        the model: the packed-documents path (`doc_ids`) finds its segments from the data, which no exported
        graph can hold, so it is left out."""
        tokens = batch[0][:, :length]
        return ExportInputs(
            model,
            (tokens,),
            ("tokens",),
            ("logits",),
            ({0: batch_dim(), 1: torch.export.Dim("length", min=1, max=self.context)},),
            f"int64 token ids of the run's {self.tokenizer_spec.name} tokenizer, at most task.context="
            f"{self.context} per row, rows of equal length (no padding mask); a document starts with the "
            f"id {self.tokenizer.doc_start_id}, as in training",
            length=tokens.shape[1],
        )

    def prediction_inputs(self, source: Path) -> list[str]:
        """The prompts of a text file, one per line (an empty line: a document's start)."""
        if not source.is_file():
            raise DataError(
                f"{source} is not a file; give a text file with one prompt per line",
                key="input",
                value=str(source),
                valid=("a text file, one prompt per line",),
            )
        try:
            return source.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"cannot read {source} as UTF-8 text ({type(e).__name__})") from None

    def predict(
        self,
        model: nn.Module,
        items: Sequence[str],
        *,
        max_new_tokens: Annotated[int, Bounds(ge=0)] = 200,
        temperature: Annotated[float, Bounds(ge=0)] = 0.8,
        top_k: Annotated[int, Bounds(ge=0)] = 0,
        top_p: Annotated[float, Bounds(gt=0, le=1)] = 1.0,
        stop: str = "",
        seed: Annotated[int, Bounds(ge=0)] = 0,
        overflow_keep: Annotated[int, Bounds(ge=0)] = 0,
    ) -> list[dict[str, Any]]:
        """Each prompt and its sampled continuation (`generate` with the model's KV cache, one prompt at a
        time).

        max_new_tokens: most tokens sampled after each prompt (fewer when a document ends)
        temperature: sampling temperature (0: always the likeliest token)
        top_k: sample among the k likeliest tokens only (0: the whole distribution)
        top_p: sample among the fewest likeliest tokens holding this much probability (1: all)
        stop: end each continuation before the first place it contains this text (\\n, \\t: newline, tab)
        seed: seed of the sampling; the same seed gives the same text for a prompt
        overflow_keep: tokens kept when the context is full (0: half of it)
        """
        stops = (
            [re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t"}.get(m[1], "\\"), stop)] if stop else []
        )
        return [
            {
                "prompt": p,
                "text": self.generate(
                    model,
                    p,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_k=top_k or None,
                    top_p=top_p,
                    stop=stops,
                    seed=seed,
                    overflow_keep=overflow_keep or None,
                ),
            }
            for p in items
        ]

    def generate(
        self,
        model: nn.Module,
        prompt: str,
        *,
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] = (),
        seed: int = 0,
        overflow_keep: int | None = None,
    ) -> str:
        """The prompt and a sampled continuation, decoded together; the same seed gives the same text (the
        options' defaults are `predict`'s, which the command lines use).

        Sampling as in the model's `stream` (temperature 0: greedy; top_k, top_p: off when None). Generation
        ends at a document end, after `max_new_tokens`, or as soon as the continuation contains one of the
        `stop` strings, which is cut off together with anything decoded after it (one token can hold more).
        Decoding both together keeps word tokenizers (torchtext) from gluing the first new word onto the
        prompt; with bytes or BPE the result starts with the prompt exactly.
        """
        ids = [self.tokenizer.doc_start_id, *self.tokenizer.encode(prompt)]  # a prompt starts a document
        return self.continue_ids(
            model,
            ids,
            echo=True,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop=stop,
            seed=seed,
            overflow_keep=overflow_keep,
        )

    def continue_ids(
        self,
        model: nn.Module,
        ids: Sequence[int],
        *,
        echo: bool,
        end: Sequence[int] = (),
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] = (),
        seed: int = 0,
        overflow_keep: int | None = None,
    ) -> str:
        """Text the model's `stream` samples after the prompt `ids` (`generate`'s options): decoded together
        with the prompt when `echo`, else the new text alone. It ends at a document end, at the ids `end`
        (left out), after `max_new_tokens`, or as soon as it contains one of the `stop` strings, which is cut
        off together with anything decoded after it."""
        stops = [stop] if isinstance(stop, str) else list(stop)
        if "" in stops:
            raise ConfigError("stop='' would end generation before it starts; give a non-empty string")
        tok = self.tokenizer
        head = list(ids) if echo else []
        start = len(tok.decode(head))
        device = next(model.parameters()).device
        new: list[int] = []
        tokens = model.stream(
            torch.tensor(list(ids), device=device),
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_id=tok.eos_id,
            generator=torch.Generator().manual_seed(seed),
            overflow_keep=overflow_keep,
        )
        for token in tokens:
            new.append(token)
            if end and new[-len(end) :] == list(end):
                del new[-len(end) :]
                break
            if stops:
                text = tok.decode(head + new)
                cut = min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)
                if cut >= 0:
                    return text[:cut]
        return tok.decode(head + new)
