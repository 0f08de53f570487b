"""JSON Lines files (one JSON object a line), read the one way every reader here reads them: streamed, blank
lines skipped, each line numbered as an editor numbers it, and a line that is not a JSON object named
`file:line` with what is wrong with it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """(line number, object, None) of each non-blank line of the JSONL file at `path`, or (line number,
    None, why) where the line is not a JSON object; an unreadable file raises OSError or UnicodeDecodeError
    (each caller names it in its own terms)."""
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield n, None, f"not valid JSON ({e.msg})"
                continue
            if isinstance(row, dict):
                yield n, row, None
            else:
                yield n, None, f"a JSON {type(row).__name__}, not an object"


def read_jsonl(path: str | Path, bad: Callable[[str, str], None]) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of each JSON object line of `path`; each line that is not one is handed to
    `bad(where, why)` (where: `path:line`), e.g. `core.data.bad_samples.BadSamples.add`."""
    rows = []
    for n, row, why in jsonl_lines(path):
        if row is None:
            bad(f"{path}:{n}", str(why))
        else:
            rows.append((n, row))
    return rows
