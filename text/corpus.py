"""Text sources: the embedded King James Bible, and the user's text files or labelled CSV/JSONL tables."""

from __future__ import annotations

import csv
import functools
import json
import lzma
import zlib
from dataclasses import dataclass
from pathlib import Path

from core.errors import DataError

KJV_PATH = Path(__file__).resolve().parent / "data" / "kjv.tsv.xz"

#: The eight book groups, each a run of consecutive books in canonical order (66 books in all).
BOOK_GROUPS: list[tuple[str, int]] = [
    ("Law", 5),  # Genesis .. Deuteronomy
    ("History", 12),  # Joshua .. Esther
    ("Wisdom", 5),  # Job .. Song of Solomon
    ("Major Prophets", 5),  # Isaiah .. Daniel
    ("Minor Prophets", 12),  # Hosea .. Malachi
    ("Gospels and Acts", 5),  # Matthew .. Acts
    ("Epistles", 21),  # Romans .. Jude
    ("Revelation", 1),
]
TEXT_SUFFIXES = (".txt", ".text", ".md")


@dataclass(frozen=True)
class Verse:
    """One verse of the embedded KJV."""

    book: str
    book_index: int
    chapter: int
    verse: int
    text: str

    @property
    def reference(self) -> str:
        """E.g. 'Genesis 1:1'."""
        return f"{self.book} {self.chapter}:{self.verse}"


@functools.lru_cache(maxsize=1)
def kjv_verses() -> tuple[Verse, ...]:
    """All 31,102 verses of the embedded KJV, in canonical order."""
    if not KJV_PATH.is_file():
        raise DataError(f"{KJV_PATH} is missing; rebuild it with `python scripts/make_kjv.py`")
    verses, books = [], []
    for line in lzma.decompress(KJV_PATH.read_bytes()).decode("utf-8").splitlines():
        book, chapter, verse, text = line.split("\t")
        if not books or books[-1] != book:
            books.append(book)
        verses.append(Verse(book, len(books) - 1, int(chapter), int(verse), text))
    return tuple(verses)


def book_group(book_index: int) -> int:
    """Index into BOOK_GROUPS of the book at `book_index` (0 = Genesis)."""
    end = 0
    for g, (_, n) in enumerate(BOOK_GROUPS):
        end += n
        if book_index < end:
            return g
    raise ValueError(f"book index {book_index} is out of range (66 books)")


def kjv_books() -> list[str]:
    """The 66 books as documents: each book's verses, one per line."""
    by_book: dict[int, list[str]] = {}
    for v in kjv_verses():
        by_book.setdefault(v.book_index, []).append(v.text)
    return ["\n".join(lines) + "\n" for _, lines in sorted(by_book.items())]


def in_validation(key: str, val_fraction: float) -> bool:
    """Deterministic split by a hash of `key`: the same item lands in the same split on every machine."""
    return zlib.crc32(key.encode("utf-8")) % 10_000 < round(val_fraction * 10_000)


def split_tail(doc: str, val_fraction: float) -> tuple[str, str]:
    """Split one document into (head, tail) at the last line break before `1 - val_fraction` of its length."""
    if val_fraction <= 0:
        return doc, ""
    cut = int(len(doc) * (1 - val_fraction))
    nl = doc.rfind("\n", 0, cut)
    cut = nl + 1 if nl > 0 else cut
    return doc[:cut], doc[cut:]


def read_text_documents(root: str) -> list[str]:
    """Every text file under `root` (a file, or a folder searched recursively) as one document each."""
    path = Path(root).expanduser()
    if not root or not path.exists():
        raise DataError(
            f"data.root={root!r} does not exist; point it at a text file or a folder of .txt files"
        )
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES)
    if not files:
        raise DataError(f"data.root={root}: no {'/'.join(TEXT_SUFFIXES)} files found under it")
    docs = []
    for f in files:
        try:
            docs.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(
                f"{f} is not UTF-8 text ({e.reason} at byte {e.start}); convert it or remove it"
            ) from None
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"data.root={root}: every text file is empty")
    return docs


def read_labelled(path: str) -> list[tuple[str, str]]:
    """(text, label) rows of a CSV (header row) or JSONL file with `text` and `label` fields."""
    p = Path(path).expanduser()
    if not path or not p.is_file():
        raise DataError(f"{path!r} is not a file; give a .csv or .jsonl file with 'text' and 'label' fields")
    rows: list[dict] = []
    if p.suffix == ".jsonl":
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{n}: not valid JSON ({e.msg}); each line must be one object") from None
    elif p.suffix == ".csv":
        with p.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    else:
        raise DataError(f"{p}: unknown format {p.suffix!r}; use .csv (with a header row) or .jsonl")
    out = []
    for n, row in enumerate(rows, start=1):
        if not isinstance(row, dict) or "text" not in row or "label" not in row:
            raise DataError(f"{p}: row {n} lacks a 'text' or 'label' field; both are required")
        out.append((str(row["text"]), str(row["label"])))
    if not out:
        raise DataError(f"{p} holds no rows")
    return out
