"""What `recipes.predict` and `recipes.transcribe` give the ASR task: audio files or a manifest's rows, and
the WER/CER of the transcripts a manifest has references for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from audio.datasets import audio_files, manifest_rows
from audio.scoring import UtteranceScores, english_normalizer
from audio.transcripts import normalize_transcript
from core.errors import DataError

#: what `recipes.predict input=` takes as a manifest rather than an audio file
MANIFEST_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class AudioInput:
    """One audio file to transcribe, with its reference transcript (normalized) when a manifest gives one."""

    path: Path
    reference: str | None = None


def resampled(wav: torch.Tensor, sample_rate: int, to_rate: int) -> torch.Tensor:
    """A waveform (S,) at `sample_rate` played at `to_rate` (the task's), as torchaudio resamples it."""
    if sample_rate == to_rate:
        return wav
    import torchaudio.functional as AF

    return AF.resample(wav, sample_rate, to_rate)


def waveform_batch(wavs: Sequence[torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Mono waveforms (S,) as one zero-padded batch on `device`, as the task's front end takes it."""
    return {
        "audio": torch.nn.utils.rnn.pad_sequence(list(wavs), batch_first=True).to(device),
        "audio_lengths": torch.tensor([len(w) for w in wavs], device=device),
    }


def utterances(source: Path) -> list[AudioInput]:
    """An audio file, every audio file under a folder, or a JSONL manifest's rows (audio_filepath, and
    text: a reference to score against, optional)."""
    if source.suffix.lower() in MANIFEST_SUFFIXES:
        rows = manifest_rows(source, need_text=False)
        if not rows:
            raise DataError(f"manifest {source} has no rows")
        return [AudioInput(a, None if t is None else normalize_transcript(t)) for a, t in rows]
    return [AudioInput(p) for p in audio_files(source)]


def scores(items: Sequence[AudioInput], rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """WER and CER (pooled, raw and normalised, as validation computes them) over the items a manifest gave
    references."""
    scored = [(u.reference, r["text"]) for u, r in zip(items, rows, strict=True) if u.reference is not None]
    if not scored:
        return {}
    refs, hyps = zip(*scored, strict=True)
    utterances = UtteranceScores(english_normalizer())
    utterances.add(refs, hyps)
    return {**utterances.rates(), "scored": len(scored)}
