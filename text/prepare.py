"""Tokenize a corpus of text, JSONL or parquet files into the shards of `text.token_shards`, in parallel,
resumably and idempotently (`python -m recipes.prepare` is the command line).

Two passes. The first tokenizes each source file in a worker process and saves its packed train and
validation tokens under `OUT/.work/` (one file per source, written atomically): a killed prepare keeps every
file it finished, and the next run tokenizes only the rest. The second, sequential and bound by the disk,
cuts the sources' tokens in order into fixed-size shards, each written atomically, then writes
`manifest.json` last and removes `.work/` (the steps of every prepared folder, `core.data.prepared`). A folder
whose manifest records the same inputs (the sources' paths, sizes and modification times, the tokenizer and
the settings) is left as it is.

Each document goes wholly to one split, by a hash of its place (`file:row`), as nanoGPT's and torchtitan's
users expect of a held-out set: no document is cut in two, and adding files never moves an old one.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.cpuload import usable_cpus
from core.data.bad_samples import DEFAULT_POLICY, BadSamplePolicy, BadSamples
from core.data.jsonl import jsonl_lines
from core.data.prepared import WORK, prepare_folder
from core.errors import ConfigError, DataError
from core.files import file_sha256, write_atomic
from text.corpus import CONTROL_CHARS, TEXT_SUFFIXES, in_validation, text_problem
from text.token_shards import FORMAT, SPLITS, ShardSet, ShardWriter, shard_files, token_dtype
from text.tokenizer import BPETokenizer, ByteTokenizer, PretrainedTokenizer, Tokenizer, tokenizer_hash

#: what prepare reads: whole text files (one document each), JSONL and parquet (a `text` field per row)
SOURCE_SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
#: tokenizers prepare can write for (torchtext's word vocabulary is fitted per run and legacy-only)
PREPARE_TOKENIZERS = ("bytes", "bpe", "pretrained")


@dataclass(frozen=True)
class TokenizerChoice:
    """The tokenizer to prepare with: `bytes`, `bpe` (trained on up to `bpe_sample_mb` MB of the training
    documents, in file order) or `pretrained` (`folder`'s tokenizer.json)."""

    name: str = "bytes"
    bpe_vocab_size: int = 2048
    folder: str = ""
    bpe_sample_mb: int = 256


def list_sources(root: str) -> list[Path]:
    """The source files under `root` (a file, or a folder searched recursively), in path order."""
    path = Path(root).expanduser()
    if not root or not path.exists():
        raise DataError(
            f"data.root={root!r} does not exist; point it at a folder of .txt, .jsonl or .parquet files",
            key="data.root",
            value=str(root),
            valid=("a folder", "a .txt/.jsonl/.parquet file"),
        )
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file())
    if not files:
        raise DataError(
            f"data.root={root}: no {'/'.join(SOURCE_SUFFIXES)} files under it",
            key="data.root",
            value=str(root),
            valid=SOURCE_SUFFIXES,
        )
    return files


def check_parquet(files: list[Path]) -> None:
    """A one-line ConfigError when a source is parquet and pyarrow, which reads it, is not installed."""
    parquet = next((f for f in files if f.suffix == ".parquet"), None)
    if parquet is None:
        return
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{parquet}: reading parquet needs pyarrow, which is not installed: pip install -c "
            "constraints.txt -e '.[parquet]' (or leave the .parquet files out of data.root)",
            key="data.root",
            value=str(parquet),
            valid=("the parquet extra",),
        ) from None


def documents(path: Path) -> Iterator[tuple[str, str, str | None, str]]:
    """(where, row, problem or None, text) of each document of a source: the whole of a text file (row
    "0"), each row's `text` of a JSONL file (row: its line number) or a parquet file (its row index)."""
    if path.suffix in TEXT_SUFFIXES:
        try:
            problem, text = text_problem(path)
        except OSError as e:
            problem, text = f"cannot read it ({e.strerror})", ""
        yield str(path), "0", problem, text
        return
    try:
        rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path)
        for row, text, problem in rows:
            problem = problem or _document_problem(text)
            yield f"{path}:{row}", str(row), problem, text if problem is None else ""
    except (OSError, UnicodeDecodeError) as e:
        yield str(path), "0", f"cannot read it ({type(e).__name__}: {e})", ""


def _document_problem(text: Any) -> str | None:
    if text is None:
        return "no text field"
    if not isinstance(text, str):
        return "text is not a string"
    if not text.strip():
        return "empty document"
    m = CONTROL_CHARS.search(text)
    return f"control character {m.group()!r} at character {m.start()}: binary, not text" if m else None


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    for n, row, why in jsonl_lines(path):
        yield n, None if row is None else row.get("text"), why


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 0
    try:  # a damaged file or one without a `text` column is a bad source, named and counted, not a traceback
        table = pq.ParquetFile(path)
        if "text" not in table.schema_arrow.names:
            yield n, None, f"no text column (columns: {', '.join(table.schema_arrow.names)})"
            return
        for batch in table.iter_batches(columns=["text"]):
            for text in batch.column(0).to_pylist():
                yield n, text, None
                n += 1
    except pa.ArrowException as e:
        yield n, None, f"cannot read it as parquet ({type(e).__name__}: {e})"


def tokenizer_for_files(
    choice: TokenizerChoice, files: list[Path], val_fraction: float, root: Path
) -> Tokenizer:
    """The tokenizer to prepare with; bpe is trained on a sample of the training documents."""
    if choice.name == "bytes":
        return ByteTokenizer()
    if choice.name == "pretrained":
        return PretrainedTokenizer(choice.folder)
    texts, size = [], 0
    for f in files:
        for _, row, problem, text in documents(f):
            if problem is None and not _held_out(f, row, root, val_fraction):
                texts.append(text)
                size += len(text)
        if size >= choice.bpe_sample_mb * 2**20:
            break
    return BPETokenizer.train(texts, choice.bpe_vocab_size)


def _held_out(path: Path, row: str, root: Path, val_fraction: float) -> bool:
    # keyed by the path relative to data.root, so a moved corpus keeps its split
    return in_validation(f"{_relative(path, root)}:{row}", val_fraction)


def _relative(path: Path, root: Path) -> str:
    return path.name if root.is_file() else str(path.relative_to(root))


# -- the first pass: one source file at a time, in worker processes -----------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(recipe: tuple[str, str]) -> None:
    """Load the tokenizer once per worker from what the parent wrote (spawned workers share nothing)."""
    _WORKER["tokenizer"] = _load_tokenizer(recipe)


def _load_tokenizer(recipe: tuple[str, str]) -> Tokenizer:
    name, arg = recipe
    if name == "bytes":
        return ByteTokenizer()
    if name == "pretrained":
        return PretrainedTokenizer(arg)
    import tokenizers

    return BPETokenizer(tokenizers.Tokenizer.from_file(arg))


def tokenize_source(job: dict[str, Any]) -> dict[str, Any]:
    """Tokenize one source into `job["work"]` (.npz, atomically): per split its packed stream (EOS + doc +
    EOS each) and each document's packed length; returns the source's sha256, counts and bad documents."""
    tok: Tokenizer = _WORKER.get("tokenizer") or _load_tokenizer(job["recipe"])
    path, root = Path(job["path"]), Path(job["root"])
    docs: dict[str, list[str]] = {s: [] for s in SPLITS}
    bad: list[tuple[str, str]] = []
    for where, row, problem, text in documents(path):
        if problem:
            bad.append((where, problem))
        else:
            docs["val" if _held_out(path, row, root, job["val_fraction"]) else "train"].append(text)
    arrays: dict[str, np.ndarray] = {}
    dtype = np.dtype(job["dtype"])
    for split, texts in docs.items():
        if isinstance(tok, ByteTokenizer):  # the UTF-8 bytes are the ids: no Python list of ints per byte
            ids = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        else:
            ids = [np.asarray(d, dtype=dtype) for d in tok.encode_batch(texts)]
        lengths = np.array([len(d) + 2 for d in ids], dtype=np.int64)
        eos = np.array([tok.eos_id], dtype=dtype)
        # as the in-memory packing (text.lm_data.PackedChunks)
        start = np.array([tok.doc_start_id], dtype=dtype)
        parts = [p for d in ids for p in (start, d, eos)]
        stream = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
        arrays[f"{split}_tokens"], arrays[f"{split}_lengths"] = stream, lengths
    meta = {
        "sha256": _sha256(path),
        "documents": sum(len(t) for t in docs.values()),
        "bad": bad,
    }
    write_atomic(Path(job["work"]), lambda f: np.savez(f, meta=np.array(json.dumps(meta)), **arrays))
    return meta


def _sha256(path: Path) -> str:
    """`file_sha256`, or an empty file's hash when the source cannot be read (its documents are counted
    bad where they are read)."""
    try:
        return file_sha256(path)
    except OSError:
        return hashlib.sha256().hexdigest()


# -- the whole command ---------------------------------------------------------------------------------------


def prepare(
    root: str,
    out: str,
    *,
    tokenizer: TokenizerChoice = TokenizerChoice(),
    workers: int = 0,
    shard_tokens: int = 1 << 26,
    val_fraction: float = 0.01,
    policy: BadSamplePolicy = DEFAULT_POLICY,
    progress: bool = True,
) -> dict[str, Any]:
    """Prepare `root`'s sources into shards in `out` (workers: processes, 0 = one per core); the manifest,
    with `"status"`: "prepared", or "up to date" when `out` already holds these inputs prepared."""
    files = list_sources(root)
    check_parquet(files)
    run = TokenPrepare(
        root=root,
        files=files,
        stats=[f.stat() for f in files],
        tokenizer=tokenizer,
        workers=workers,
        shard_tokens=shard_tokens,
        val_fraction=val_fraction,
        policy=policy,
        progress=progress,
    )
    return prepare_folder(
        out,
        run.inputs(),
        finished=lambda dest: ShardSet(dest).manifest,
        build=run.build,
        outputs=[f"{split}-*{ext}" for split in SPLITS for ext in (".bin", ".idx.npy")],
        listed=lambda manifest: shard_files(manifest["splits"]),
    )


@dataclass(frozen=True)
class TokenPrepare:
    """One prepare of sources into token shards: its inputs, and its build step for `prepare_folder`."""

    root: str
    files: list[Path]
    stats: list[os.stat_result]
    tokenizer: TokenizerChoice
    workers: int
    shard_tokens: int
    val_fraction: float
    policy: BadSamplePolicy
    progress: bool

    @property
    def base(self) -> Path:
        """data.root, the folder source paths are relative to."""
        return Path(self.root).expanduser()

    def inputs(self) -> dict[str, Any]:
        """What the shards are made from: the tokenizer, the settings, each source's path, size and time."""
        return {
            "tokenizer": {
                **self.tokenizer.__dict__,
                "folder": _file_sha(Path(self.tokenizer.folder) / "tokenizer.json"),
            },
            "shard_tokens": self.shard_tokens,
            "val_fraction": self.val_fraction,
            "sources": [
                [_relative(f, self.base), s.st_size, s.st_mtime_ns]
                for f, s in zip(self.files, self.stats, strict=True)
            ],
        }

    def build(self, dest: Path, fingerprint: str) -> dict[str, Any]:
        """Tokenize the sources (the first pass), cut them into shards (the second); the manifest."""
        choice = self.tokenizer
        tok = tokenizer_for_files(choice, self.files, self.val_fraction, self.base)
        recipe = ("bytes", "")
        if choice.name == "bpe":
            tok.backend.save(str(dest / "tokenizer.json"))
            recipe = ("bpe", str(dest / "tokenizer.json"))
        elif choice.name == "pretrained":
            recipe = ("pretrained", choice.folder)
        thash, dtype = tokenizer_hash(tok), token_dtype(tok.vocab_size)
        jobs = self.jobs(dest / WORK, thash, recipe, dtype)
        self.tokenize([j for j in jobs if not Path(j["work"]).is_file()], len(jobs), recipe)
        bad = BadSamples(self.policy, f"data.root={self.root}", "documents")
        sources, splits = self.write_shards(dest, jobs, dtype, bad)
        return {
            "format": FORMAT,
            "inputs_sha256": fingerprint,
            "tokenizer": {
                "name": choice.name,
                "hash": thash,
                "vocab_size": tok.vocab_size,
                "eos_id": tok.eos_id,
                **({"bpe_vocab_size": choice.bpe_vocab_size} if choice.name == "bpe" else {}),
            },
            "dtype": dtype.str,
            "shard_tokens": self.shard_tokens,
            "val_fraction": self.val_fraction,
            "root": str(self.base),
            "sources": sources,
            "bad_documents": [{"where": w, "why": y} for w, y in bad.found],
            "splits": splits,
        }

    def jobs(self, work: Path, thash: str, recipe: tuple[str, str], dtype: np.dtype) -> list[dict[str, Any]]:
        """One `tokenize_source` job per source; its work file is named by what it is made from, so a
        resumed prepare finds the ones a killed one finished."""
        work.mkdir(exist_ok=True)
        jobs = []
        for i, (f, s) in enumerate(zip(self.files, self.stats, strict=True)):
            key = hashlib.sha256(
                f"{thash}|{self.val_fraction}|{_relative(f, self.base)}|{s.st_size}|{s.st_mtime_ns}".encode()
            )
            job = {
                "path": str(f),
                "root": str(self.base),
                "recipe": recipe,
                "val_fraction": self.val_fraction,
            }
            jobs.append(
                {**job, "dtype": dtype.str, "work": str(work / f"{i:06d}-{key.hexdigest()[:16]}.npz")}
            )
        return jobs

    def tokenize(self, todo: list[dict[str, Any]], total: int, recipe: tuple[str, str]) -> None:
        """The first pass: run the jobs `todo` (of `total`), in worker processes unless one is enough."""
        from tqdm import tqdm

        workers = min(self.workers or usable_cpus(), max(1, len(todo)))
        bar = tqdm(
            total=sum(Path(j["path"]).stat().st_size for j in todo),
            unit="B",
            unit_scale=True,
            desc=f"tokenizing {len(todo)}/{total} files",
            disable=not self.progress,
        )
        with bar:
            if workers == 1:
                _drain((tokenize_source(j) for j in todo), todo, bar)
            else:
                ctx = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
                with ctx.Pool(workers, initializer=_init_worker, initargs=(recipe,)) as pool:
                    _drain(pool.imap(tokenize_source, todo, chunksize=1), todo, bar)

    def write_shards(
        self, dest: Path, jobs: list[dict[str, Any]], dtype: np.dtype, bad: BadSamples
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The second pass: the sources' tokens in order into shards; (the sources', the splits' entries)."""
        writers = {s: ShardWriter(dest, s, dtype, self.shard_tokens) for s in SPLITS}
        sources, documents_seen = [], 0
        for j, f, s in zip(jobs, self.files, self.stats, strict=True):
            with np.load(j["work"]) as z:
                meta = json.loads(str(z["meta"]))
                for split, w in writers.items():
                    w.add(z[f"{split}_tokens"], z[f"{split}_lengths"])
            for where, why in meta["bad"]:
                bad.add(where, why)
            documents_seen += meta["documents"] + len(meta["bad"])
            sources.append(
                {
                    "path": _relative(f, self.base),
                    "size": s.st_size,
                    "mtime_ns": s.st_mtime_ns,
                    "sha256": meta["sha256"],
                    "documents": meta["documents"],
                    "bad": len(meta["bad"]),
                }
            )
        bad.check(documents_seen)
        splits = {}
        for split, w in writers.items():
            shards = w.close()
            splits[split] = {"tokens": w.written, "documents": w.documents, "shards": shards}
        return sources, splits


def _drain(results: Iterator[dict[str, Any]], todo: list[dict[str, Any]], bar: Any) -> None:
    for job, _ in zip(todo, results, strict=True):
        bar.update(Path(job["path"]).stat().st_size)


def _file_sha(path: Path) -> str:
    return _sha256(path) if path.is_file() else ""
