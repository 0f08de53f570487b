"""What `recipes.predict` and `recipes.transcribe` give the ASR task: audio files or a manifest's rows, and
the WER/CER of the transcripts a manifest has references for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from audio.ctc import edit_counts, error_rates
from audio.datasets import audio_files, manifest_rows
from audio.transcripts import normalize_transcript
from core.errors import DataError

#: what `recipes.predict input=` takes as a manifest rather than an audio file
MANIFEST_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class Utterance:
    """One audio file to transcribe, with its reference transcript (normalized) when a manifest gives one."""

    path: Path
    reference: str | None = None


def utterances(source: Path) -> list[Utterance]:
    """An audio file, every audio file under a folder, or a JSONL manifest's rows (audio_filepath, and
    text: a reference to score against, optional)."""
    if source.suffix.lower() in MANIFEST_SUFFIXES:
        rows = manifest_rows(source, need_text=False)
        if not rows:
            raise DataError(f"manifest {source} has no rows")
        return [Utterance(a, None if t is None else normalize_transcript(t)) for a, t in rows]
    return [Utterance(p) for p in audio_files(source)]


def scores(items: Sequence[Utterance], rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """WER and CER (pooled, as validation computes them) over the items a manifest gave references."""
    scored = [(u.reference, r["text"]) for u, r in zip(items, rows, strict=True) if u.reference is not None]
    if not scored:
        return {}
    refs, hyps = zip(*scored, strict=True)
    return {**error_rates(edit_counts(refs, hyps)), "scored": len(scored)}
