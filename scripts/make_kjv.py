"""Build text/data/kjv.tsv.xz, the embedded King James Bible, from Debian's `bible-kjv` package.

Usage (Debian/Ubuntu, amd64; needs network access to the Debian archive and libreadline8):
    python scripts/make_kjv.py                 # downloads bible-kjv + bible-kjv-text with apt-get
    python scripts/make_kjv.py --debs DIR      # uses bible-kjv_*.deb and bible-kjv-text_*.deb already in DIR

The package stores the text in its own compressed format (bible.data); its `bible` program is the reference
decoder, so this script unpacks both .debs without installing them and asks `bible` for Gen1:1-Rev22:21, one
verse per line. The KJV text is public domain (translation of 1611); the Debian packaging notes this in
/usr/share/doc/bible-kjv-text/copyright. Output: one verse per line, `book<TAB>chapter<TAB>verse<TAB>text`,
xz-compressed (~1 MB). The script checks the verse and book counts and prints the SHA-256 of the text, which
is pinned below so a rebuild that differs is noticed.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import lzma
import os
import re
import subprocess
import sys
import tempfile

# The 66 books in canonical order, keyed by the abbreviation `bible -f` prints before each verse.
BOOKS = [
    ("Ge", "Genesis"), ("Exo", "Exodus"), ("Lev", "Leviticus"), ("Num", "Numbers"), ("Deu", "Deuteronomy"),
    ("Josh", "Joshua"), ("Jdgs", "Judges"), ("Ruth", "Ruth"), ("1Sm", "1 Samuel"), ("2Sm", "2 Samuel"),
    ("1Ki", "1 Kings"), ("2Ki", "2 Kings"), ("1Chr", "1 Chronicles"), ("2Chr", "2 Chronicles"),
    ("Ezra", "Ezra"), ("Neh", "Nehemiah"), ("Est", "Esther"), ("Job", "Job"), ("Psa", "Psalms"),
    ("Prv", "Proverbs"), ("Eccl", "Ecclesiastes"), ("SSol", "Song of Solomon"), ("Isa", "Isaiah"),
    ("Jer", "Jeremiah"), ("Lam", "Lamentations"), ("Eze", "Ezekiel"), ("Dan", "Daniel"), ("Hos", "Hosea"),
    ("Joel", "Joel"), ("Amos", "Amos"), ("Obad", "Obadiah"), ("Jonah", "Jonah"), ("Mic", "Micah"),
    ("Nahum", "Nahum"), ("Hab", "Habakkuk"), ("Zep", "Zephaniah"), ("Hag", "Haggai"), ("Zec", "Zechariah"),
    ("Mal", "Malachi"), ("Mat", "Matthew"), ("Mark", "Mark"), ("Luke", "Luke"), ("John", "John"),
    ("Acts", "Acts"), ("Rom", "Romans"), ("1Cor", "1 Corinthians"), ("2Cor", "2 Corinthians"),
    ("Gal", "Galatians"), ("Eph", "Ephesians"), ("Phi", "Philippians"), ("Col", "Colossians"),
    ("1Th", "1 Thessalonians"), ("2Th", "2 Thessalonians"), ("1Tim", "1 Timothy"), ("2Tim", "2 Timothy"),
    ("Titus", "Titus"), ("Phmn", "Philemon"), ("Heb", "Hebrews"), ("Jas", "James"), ("1Pet", "1 Peter"),
    ("2Pet", "2 Peter"), ("1Jn", "1 John"), ("2Jn", "2 John"), ("3Jn", "3 John"), ("Jude", "Jude"),
    ("Rev", "Revelation"),
]  # fmt: skip
VERSES = 31102
#: SHA-256 of the uncompressed TSV built from bible-kjv-text 4.38 (Debian bookworm).
EXPECTED_SHA256 = "6242e02ba4e80303fa3db490428901eb6e89a18cab078d2a230aaffeb4cc0f9c"
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "text", "data", "kjv.tsv.xz")
_LINE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def fetch_debs(workdir: str) -> str:
    """Download the two packages with apt-get into `workdir` and return it."""
    subprocess.run(["apt-get", "download", "bible-kjv", "bible-kjv-text"], cwd=workdir, check=True)
    return workdir


def dump_verses(debs: str, workdir: str) -> str:
    """Unpack the .debs and return `bible`'s one-verse-per-line dump of the whole text."""
    for pattern in ("bible-kjv_*.deb", "bible-kjv-text_*.deb"):
        found = sorted(glob.glob(os.path.join(debs, pattern)))
        if not found:
            sys.exit(f"no {pattern} in {debs}; run without --debs to download it")
        subprocess.run(["dpkg-deb", "-x", found[-1], os.path.join(workdir, "root")], check=True)
    root = os.path.join(workdir, "root", "usr")
    # -f turns pretty-printing off: one verse per line, prefixed by its reference.
    cmd = [os.path.join(root, "bin", "bible"), "-f", "-p", os.path.join(root, "lib"), "Gen1:1-Rev22:21"]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def to_tsv(dump: str) -> str:
    """Convert `bible -f` lines into `book<TAB>chapter<TAB>verse<TAB>text` lines, checking the counts."""
    names = dict(BOOKS)
    rows, seen = [], []
    for line in dump.splitlines():
        m = _LINE.match(line)
        if m is None:
            sys.exit(f"unexpected line in bible output: {line[:80]!r}")
        abbrev, chapter, verse, text = m.groups()
        if abbrev not in names:
            sys.exit(f"unknown book abbreviation {abbrev!r}")
        if not seen or seen[-1] != abbrev:
            seen.append(abbrev)
        # Collapse the source's few doubled and trailing spaces; nothing else is changed.
        rows.append(f"{names[abbrev]}\t{chapter}\t{verse}\t{' '.join(text.split())}\n")
    if len(rows) != VERSES or seen != [a for a, _ in BOOKS]:
        sys.exit(f"expected {VERSES} verses in 66 books in order, got {len(rows)} in {len(seen)} books")
    return "".join(rows)


def main() -> None:
    """Build the compressed corpus and report its hash and size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--debs", help="folder holding the two .deb files (default: download them)")
    parser.add_argument("--out", default=OUT, help="output path (default: text/data/kjv.tsv.xz)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        debs = args.debs or fetch_debs(tmp)
        tsv = to_tsv(dump_verses(debs, tmp)).encode("utf-8")
    digest = hashlib.sha256(tsv).hexdigest()
    # Fixed preset and no timestamp in the .xz container, so equal text gives equal bytes.
    blob = lzma.compress(tsv, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)
    with open(args.out, "wb") as f:
        f.write(blob)
    print(f"wrote {args.out}: {len(blob)} bytes xz, {len(tsv)} bytes text, sha256 {digest}")
    if digest != EXPECTED_SHA256:
        sys.exit(f"text differs from the pinned build (sha256 {EXPECTED_SHA256}): check the package version")


if __name__ == "__main__":
    main()
