"""Text sources: the embedded King James Bible, and the user's text files or labelled CSV/JSONL tables."""

from __future__ import annotations

import csv
import functools
import io
import lzma
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.data.bad_samples import DEFAULT_POLICY, BadSamplePolicy, BadSamples
from core.data.jsonl import read_jsonl
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
#: C0 control characters other than tab, newline, vertical tab, form feed and carriage return: text never
#: holds them, binary files and terminal captures do (a byte-level model would learn them as text)
CONTROL_CHARS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")


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


def read_text_documents(root: str, policy: BadSamplePolicy = DEFAULT_POLICY) -> list[str]:
    """Every text file under `root` (a file, or a folder searched recursively) as one document each; empty,
    non-UTF-8 or control-character files go by `policy`."""
    path = Path(root).expanduser()
    if not root or not path.exists():
        raise DataError(
            f"data.root={root!r} does not exist; point it at a text file or a folder of .txt files",
            key="data.root",
            value=str(root),
            valid=("a text file", "a folder of .txt files"),
        )
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES)
    if not files:
        raise DataError(f"data.root={root}: no {'/'.join(TEXT_SUFFIXES)} files found under it")
    bad = BadSamples(policy, f"data.root={root}", "text files")
    docs = []
    for f in files:
        problem, doc = text_problem(f)
        if problem:
            bad.add(str(f), problem)
        else:
            docs.append(doc)
    bad.check(len(files))
    return docs


def text_problem(path: Path) -> tuple[str | None, str]:
    """Why the file at `path` is not a usable document (None if it is), and its text."""
    try:
        doc = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 text ({e.reason} at byte {e.start})", ""
    if not doc.strip():
        return "empty", ""
    m = CONTROL_CHARS.search(doc)
    if m:
        return f"control character {m.group()!r} at character {m.start()}: binary, not text", ""
    return None, doc


def read_labelled(path: str, policy: BadSamplePolicy = DEFAULT_POLICY) -> list[tuple[str, str]]:
    """(text, label) rows of a CSV (header row) or JSONL file with `text` and `label` fields; rows that
    are malformed or lack a label go by `policy`, named path:line."""
    p = Path(path).expanduser()
    if not path or not p.is_file():
        raise DataError(f"{path!r} is not a file; give a .csv or .jsonl file with 'text' and 'label' fields")
    if p.suffix not in (".csv", ".jsonl"):
        raise DataError(
            f"{p}: unknown format {p.suffix!r}; use .csv (with a header row) or .jsonl",
            key="format",
            value=p.suffix,
            valid=(".csv", ".jsonl"),
        )
    bad = BadSamples(policy, str(p), "rows")
    rows = read_jsonl(p, bad.add) if p.suffix == ".jsonl" else _csv_rows(p, bad)
    out = []
    for line, row in rows:
        label = row.get("label")
        if label is None or not str(label).strip():
            bad.add(f"{p}:{line}", "no label" if label is None else "empty label")
        elif not isinstance(row.get("text"), str):
            bad.add(f"{p}:{line}", "no text field" if row.get("text") is None else "text is not a string")
        else:
            out.append((row["text"], str(label)))
    bad.check(len(out) + len(bad.found))
    if not out:
        raise DataError(f"{p} holds no rows")
    return out


def read_texts(source: Path) -> list[tuple[str, str]]:
    """(where, text) to predict on: each row of a .csv (header row) or .jsonl file with a `text` field
    (where: path:line), each .txt/.text/.md file under a folder, or one such file whole (where: its path). A
    malformed row or unreadable file is a one-line DataError naming it."""
    if source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise DataError(f"{source}: no {'/'.join(TEXT_SUFFIXES)} files under it")
    elif not source.is_file():
        raise DataError(f"{source} does not exist; give a .csv/.jsonl file with a 'text' field or text files")
    elif source.suffix in (".csv", ".jsonl"):
        return _table_texts(source)
    else:
        files = [source]
    out = []
    for f in files:
        try:
            problem, doc = text_problem(f)
        except OSError as e:
            problem, doc = f"cannot read it ({e.strerror})", ""
        if problem:
            raise DataError(f"{f}: {problem}")
        out.append((str(f), doc))
    return out


def _table_texts(p: Path) -> list[tuple[str, str]]:
    """(path:line, text) of each row of a .csv/.jsonl file; the first row without a text is a DataError."""
    bad = BadSamples(DEFAULT_POLICY, str(p), "rows")  # collected here, then the first one stops the read
    try:
        rows = read_jsonl(p, bad.add) if p.suffix == ".jsonl" else _csv_rows(p, bad, required=("text",))
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {p} ({type(e).__name__}: {e})") from None
    out = []
    for line, row in rows:
        text = row.get("text")
        if not isinstance(text, str):
            bad.add(f"{p}:{line}", "no text field" if text is None else "text is not a string")
        else:
            out.append((f"{p}:{line}", text))
    if bad.found:
        where, why = bad.found[0]
        raise DataError(f"{where}: {why}; every row needs a 'text' field")
    if not out:
        raise DataError(f"{p} holds no rows")
    return out


def _csv_rows(
    p: Path, bad: BadSamples, required: tuple[str, ...] = ("text", "label")
) -> list[tuple[int, dict[str, Any]]]:
    """(line number, header -> field) of each CSV row; rows with the wrong number of fields or broken
    quoting are recorded in `bad`. Quoting is parsed strictly, and after a broken row parsing resumes at the
    line after its start, so one unbalanced quote costs its own row, not every row it would swallow."""
    lines = io.StringIO(p.read_text(encoding="utf-8"), newline="").readlines()
    if not lines:
        return []
    header = next(csv.reader(lines[:1]))
    missing = [c for c in required if c not in header]
    if missing:
        raise DataError(
            f"{p}: the header row {header} has no {' or '.join(map(repr, missing))} column; required: "
            + ", ".join(required),
            key="columns",
            value=",".join(header),
            valid=required,
        )
    rows = []
    start = 1  # index into `lines` where the current reader begins
    while start < len(lines):
        reader = csv.reader(lines[start:], strict=True)
        first = start + 1  # 1-based line number of the row being read
        try:
            for row in reader:
                if row and len(row) != len(header):
                    bad.add(f"{p}:{first}", f"{len(row)} fields where the header has {len(header)}")
                elif row:
                    rows.append((first, dict(zip(header, row, strict=True))))
                first = start + reader.line_num + 1
            break
        except csv.Error as e:
            bad.add(f"{p}:{first}", f"broken quoting ({e})")
            start = first  # the line after the broken row's first line
    return rows
