"""Transcript text as every part of the speech stack compares it: lower case, digits spelt out, letters,
apostrophes and single spaces only. Nothing here imports torch (audio.ngram reads it)."""

from __future__ import annotations

import re

_DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def normalize_transcript(text: str) -> str:
    """Lower-case `text`, spell out digits one by one, keep only letters, apostrophes and single spaces."""
    text = text.lower()
    text = re.sub(r"\d", lambda m: f" {_DIGIT_WORDS[int(m.group())]} ", text)
    text = re.sub(r"[^a-z' ]+", " ", text)
    return " ".join(text.split())
