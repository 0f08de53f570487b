"""The embedded KJV and the readers of user text files and labelled tables."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from core.data.bad_samples import BadSamplePolicy
from core.errors import DataError
from tests.helpers import fault
from text.corpus import (
    BOOK_GROUPS,
    book_group,
    in_validation,
    kjv_books,
    kjv_verses,
    read_labelled,
    read_text_documents,
    split_tail,
)


def test_kjv_has_every_verse_in_order() -> None:
    verses = kjv_verses()
    assert len(verses) == 31102
    assert verses[0].reference == "Genesis 1:1"
    assert verses[0].text == "In the beginning God created the heaven and the earth."
    assert verses[-1].reference == "Revelation 22:21"
    assert len({v.book for v in verses}) == 66 == sum(n for _, n in BOOK_GROUPS)


def test_book_groups_match_the_canon() -> None:
    names = {v.book_index: v.book for v in kjv_verses()}
    group_of = {names[i]: BOOK_GROUPS[book_group(i)][0] for i in names}
    assert group_of["Deuteronomy"] == "Law" and group_of["Joshua"] == "History"
    assert group_of["Esther"] == "History" and group_of["Job"] == "Wisdom"
    assert group_of["Daniel"] == "Major Prophets" and group_of["Hosea"] == "Minor Prophets"
    assert group_of["Acts"] == "Gospels and Acts" and group_of["Jude"] == "Epistles"
    assert group_of["Revelation"] == "Revelation"


def test_books_as_documents_keep_all_text() -> None:
    books = kjv_books()
    assert len(books) == 66
    assert sum(b.count("\n") for b in books) == 31102


def test_hash_split_is_stable_and_near_the_fraction() -> None:
    refs = [v.reference for v in kjv_verses()]
    val = [r for r in refs if in_validation(r, 0.1)]
    assert 0.09 < len(val) / len(refs) < 0.11
    assert val == [r for r in refs if in_validation(r, 0.1)]
    assert in_validation("Genesis 1:1", 0.1) is in_validation("Genesis 1:1", 0.1)


def test_split_tail_cuts_at_a_line_break() -> None:
    head, tail = split_tail("aaaa\nbbbb\ncccc\ndddd\n", 0.2)
    assert head + tail == "aaaa\nbbbb\ncccc\ndddd\n"
    assert head.endswith("\n") and tail == "dddd\n"


def test_text_documents_from_file_and_folder(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha\n")
    (tmp_path / "sub" / "b.md").write_text("beta\n")
    (tmp_path / "skip.bin").write_bytes(b"\xff")
    assert read_text_documents(str(tmp_path)) == ["alpha\n", "beta\n"]
    assert read_text_documents(str(tmp_path / "a.txt")) == ["alpha\n"]
    with pytest.raises(DataError) as e:
        read_text_documents(str(tmp_path / "nope"))
    assert fault(e.value)[:2] == ("data.root", str(tmp_path / "nope"))
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(DataError) as e:  # 1 bad file of 3 is past data.max_bad_fraction
        read_text_documents(str(tmp_path))
    assert fault(e.value) == ("data.max_bad_fraction", "1/3", ("<= 0.01",))


def test_labelled_csv_and_jsonl(tmp_path: Path) -> None:
    csv_path = tmp_path / "d.csv"
    csv_path.write_text('text,label\n"hello, world",greet\nbye,leave\n')
    assert read_labelled(str(csv_path)) == [("hello, world", "greet"), ("bye", "leave")]
    jl = tmp_path / "d.jsonl"
    jl.write_text(
        json.dumps({"text": "x", "label": 1}) + "\n\n" + json.dumps({"text": "y", "label": 2}) + "\n"
    )
    assert read_labelled(str(jl)) == [("x", "1"), ("y", "2")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(DataError) as e:  # its one row has no label
        read_labelled(str(bad))
    assert fault(e.value) == ("data.max_bad_fraction", "1/1", ("<= 0.01",))
    (tmp_path / "d.tsv").write_text("text\tlabel\n")
    with pytest.raises(DataError) as e:
        read_labelled(str(tmp_path / "d.tsv"))
    assert fault(e.value) == ("format", ".tsv", (".csv", ".jsonl"))


def test_group_sizes_are_all_present() -> None:
    counts = Counter(book_group(v.book_index) for v in kjv_verses())
    assert sorted(counts) == list(range(8))
    assert counts[7] == 404  # Revelation has 404 verses


def test_empty_and_control_byte_text_files_are_skipped_and_named(tmp_path: Path) -> None:
    for i in range(120):
        (tmp_path / f"{i:03d}.txt").write_text(f"document {i}\n")
    (tmp_path / "empty.txt").write_text("  \n")
    assert len(read_text_documents(str(tmp_path))) == 120  # 1 of 121: under data.max_bad_fraction
    (tmp_path / "empty.txt").unlink()
    (tmp_path / "term.txt").write_text("ls\x1b[0m\x00\x01\x02 output\n")
    assert len(read_text_documents(str(tmp_path))) == 120
    with pytest.raises(DataError) as e:
        read_text_documents(str(tmp_path), BadSamplePolicy("error"))
    assert fault(e.value) == ("sample", str(tmp_path / "term.txt"), ())


def _table(path: Path, rows: list[str]) -> Path:
    path.write_text("text,label\n" + "".join(f"{r}\n" for r in rows))
    return path


def test_csv_rows_with_missing_or_empty_labels_or_wrong_field_counts_are_skipped(tmp_path: Path) -> None:
    good = [f"row {i},{'ab'[i % 2]}" for i in range(200)]
    for bad in ("no label here", "empty label,", "one,two,three"):
        rows = read_labelled(str(_table(tmp_path / "t.csv", [*good[:10], bad, *good[10:]])))
        assert len(rows) == 200 and {label for _, label in rows} == {"a", "b"}
        with pytest.raises(DataError) as e:
            read_labelled(str(tmp_path / "t.csv"), BadSamplePolicy("error"))
        assert fault(e.value) == ("sample", f"{tmp_path / 't.csv'}:12", ())  # the header, 10 rows, then it


def test_an_unbalanced_quote_costs_its_own_row_not_the_rows_it_would_swallow(tmp_path: Path) -> None:
    rows = [f"row {i},{'ab'[i % 2]}" for i in range(1, 62)]
    rows[10] = '"he said hi there,a'  # row 11: its quote never closes
    path = _table(tmp_path / "q.csv", rows)
    with pytest.raises(DataError) as e:  # 1 of 61 rows is past the default 1%
        read_labelled(str(path))
    assert fault(e.value) == ("data.max_bad_fraction", "1/61", ("<= 0.01",))
    kept = read_labelled(str(path), BadSamplePolicy(max_bad_fraction=0.05))
    assert kept == [(f"row {i}", "ab"[i % 2]) for i in range(1, 62) if i != 11]


def test_jsonl_rows_without_a_label_or_not_json_are_skipped(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"t{i}", "label": i % 3}) for i in range(250)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([*lines, json.dumps({"text": "x"}), '{"text": "y", "label": ""}']) + "\n")
    assert len(read_labelled(str(path))) == 250  # 2 of 252: under data.max_bad_fraction
    path.write_text("\n".join([*lines, "{broken"]) + "\n")
    assert len(read_labelled(str(path))) == 250
