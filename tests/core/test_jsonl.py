"""core.data.jsonl: each JSON object line with its number as an editor counts it (blank lines skipped, not
renumbered), and each line that is not an object named `file:line` for the caller's bad-sample policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.data.jsonl import jsonl_lines, read_jsonl

LINES = [
    '{"text": "a"}',
    "",
    '{"text": "b", "n": 2}',
    "not json",
    "[1, 2]",
    '"a string"',
    '  {"text": "c"}  ',
]


def test_rows_and_faults_carry_their_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    got = list(jsonl_lines(path))
    assert [n for n, _, _ in got] == [1, 3, 4, 5, 6, 7]
    assert [row for _, row, _ in got] == [
        {"text": "a"},
        {"text": "b", "n": 2},
        None,
        None,
        None,
        {"text": "c"},
    ]
    assert [why is None for _, _, why in got] == [True, True, False, False, False, True]


def test_read_jsonl_hands_each_fault_to_the_sink_named_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(LINES), encoding="utf-8")
    faults: list[tuple[str, str]] = []
    rows = read_jsonl(path, lambda where, why: faults.append((where, why)))
    assert [n for n, _ in rows] == [1, 3, 7]
    assert [where for where, _ in faults] == [f"{path}:4", f"{path}:5", f"{path}:6"]


def test_a_file_that_is_not_utf8_is_the_callers_to_name(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(UnicodeDecodeError):
        list(jsonl_lines(path))
