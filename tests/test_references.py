"""Every cross-reference in the tree resolves: `FILE.md § Heading` (or `README § Heading`, or a bare
`§ Heading` inside a Markdown page) names a heading that FILE has, and `tests/PATH.py::name` names a test that
exists. A section renamed or moved without its citations fails here, not in a reader's hands."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: what may cite a section or a test: prose, code comments, configs, scripts
SUFFIXES = {".md", ".py", ".yaml", ".toml", ".sh", ".cfg", ".txt"}
NAMES = {"Makefile"}
SKIP_DIRS = {".git", "build", "outputs", "multirun", ".venv", "node_modules", "scripts/gpu_wheels"}

# `FILE § Heading`: an optional file (README, README.md, BENCHMARKS.md, docs/x.md, optionally in backticks)
SECTION = re.compile(r"(?:`?(?P<file>(?:[\w./-]+/)?[\w-]+\.md|README)`?\s+)?§\s*(?P<text>[^§]{1,120})")
TEST_REF = re.compile(r"(?P<path>tests/[\w/]+\.py)(?:::(?P<name>[\w:]+\*?))?")
PHRASE_END = re.compile(r"[.,;:)(|\]\"*]|\s-\s|$")


def sources() -> list[Path]:
    """The repository's own text files: git's tracked files where git knows the tree, else a walk."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
        ).stdout.decode()
        paths = [REPO / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in REPO.rglob("*") if p.is_file()]
    keep = []
    for p in paths:
        rel = p.relative_to(REPO).as_posix()
        if any(rel == d or rel.startswith(d + "/") for d in SKIP_DIRS):
            continue
        if (p.suffix in SUFFIXES or p.name in NAMES) and p.is_file():
            keep.append(p)
    return keep


def headings(path: Path) -> list[str]:
    """The normalized headings of a Markdown file, code blocks left out."""
    found, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6}\s", line):
            found.append(normalize(line.lstrip("#")))
    return found


def normalize(text: str) -> str:
    """Lower case, no backticks or emphasis, single spaces."""
    return " ".join(text.replace("`", "").replace("*", "").lower().split())


def flat(path: Path) -> str:
    """The file as one line, comment markers and indents gone: a citation broken over lines reads whole."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    if path.suffix != ".md":
        lines = [re.sub(r"^\s*(#+|//)\s?", "", line) for line in lines]
    return " ".join(line.strip() for line in lines)


def resolves(text: str, names: list[str]) -> bool:
    """Whether the text after `§` starts with one of the headings, or its first phrase starts one."""
    text = normalize(text)
    number = re.match(r"(\d+)\b", text)
    if number:
        return any(re.match(rf"{number.group(1)}[.)]\s", h) for h in names)
    # a heading is cited by its whole text or by its title before a parenthesis or a colon
    short = {part for h in names for part in (h, h.split(" (")[0], h.split(":")[0])}
    if any(text.startswith(h) and not text[len(h) : len(h) + 1].isalnum() for h in short):
        return True
    phrase = text[: PHRASE_END.search(text).start()].strip()
    return bool(phrase) and any(
        h.startswith(phrase) and not h[len(phrase) : len(phrase) + 1].isalnum() for h in names
    )


def target(source: Path, name: str | None) -> Path | None:
    """The Markdown file a citation in `source` points at (None: it names no Markdown file)."""
    if name is None:
        return source if source.suffix == ".md" else None
    if name == "README":
        name = "README.md"
    for base in (REPO, source.parent):
        if (base / name).is_file():
            return base / name
    return REPO / name


def section_citations() -> list[tuple[str, str, str]]:
    """(citing file, cited file, text after §) for every `§` citation in the tree."""
    cites = []
    for src in sources():
        if src == Path(__file__).resolve():
            continue  # this file's docstring and comments show the citation syntax, they cite nothing
        last_file, last_text = None, ""
        for m in SECTION.finditer(flat(src)):
            name = m.group("file")
            # "docs/scaling.md § 4 and § 6": a bare § a few words after a citation cites the same file
            if name is None and len(last_text) < 12:
                name = last_file
            last_file, last_text = name, m.group("text")
            md = target(src, name)
            if md is not None:
                cites.append(
                    (src.relative_to(REPO).as_posix(), md.relative_to(REPO).as_posix(), m.group("text"))
                )
    return cites


def test_every_section_citation_names_a_heading_of_its_file() -> None:
    cites = section_citations()
    assert len(cites) > 50  # the scan sees the tree's citations (there were 90 when this test was written)
    cache: dict[str, list[str]] = {}
    stale = []
    for src, md, text in cites:
        path = REPO / md
        if not path.is_file():
            stale.append((src, md, "no such file"))
            continue
        names = cache.setdefault(md, headings(path))
        if not resolves(text, names):
            stale.append((src, md, text[:50]))
    assert stale == []


def test_every_test_citation_names_a_test_that_exists() -> None:
    cites = []
    for src in sources():
        if src.parts[-2:-1] == ("tests",) and src.name == Path(__file__).name:
            continue
        for m in TEST_REF.finditer(flat(src)):
            cites.append((src.relative_to(REPO).as_posix(), m.group("path"), m.group("name")))
    assert len(cites) > 20
    missing = []
    for src, path, name in cites:
        file = REPO / path
        if not file.is_file():
            missing.append((src, path))
            continue
        if name:
            body = file.read_text(encoding="utf-8")
            for part in name.split("::"):
                # `name_*` cites every test whose name starts so
                tail = r"\w*" if part.endswith("*") else r"\b"
                stem = re.escape(part.rstrip("*"))
                if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{stem}{tail}", body, re.M):
                    missing.append((src, f"{path}::{name}"))
                    break
    assert missing == []


@pytest.mark.parametrize(
    ("text", "names", "ok"),
    [
        ("Compile has the table", ["compile"], True),
        ("ASR recipe). Next", ["asr recipe (audio)"], True),
        ("5 lists the order", ["5. the order of the transforms"], True),
        ("Compilers", ["compile"], False),
        ("channels-last", ["channels_last (image classification, eager)"], False),
        ("6", ["5. the order"], False),
    ],
)
def test_the_resolver_matches_headings_by_prefix_at_a_word_boundary(
    text: str, names: list[str], ok: bool
) -> None:
    assert resolves(text, names) is ok
