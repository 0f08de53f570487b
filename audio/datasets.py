"""Speech datasets: the embedded eSpeak NG corpus, LibriSpeech folders and NeMo-style JSONL manifests.

Every source becomes a list of `Clip`s, checked up front (unreadable, empty, multi-channel or non-finite
audio is skipped and reported with its path; more than 1% bad stops the run), then a `SpeechDataset` that
reads audio with soundfile and resamples with torchaudio.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF
from torch.utils.data import Dataset

from audio.corpus import ensure_corpus
from audio.ctc import CharTokenizer, normalize_transcript
from core.bounds import Bounds
from core.errors import ConfigError, DataError
from core.registry import DATASETS

log = logging.getLogger(__name__)

#: Largest fraction of a split that may be skipped as bad audio before the run stops.
MAX_BAD_FRACTION = 0.01


@dataclass(frozen=True)
class Clip:
    """One utterance: audio file, normalised transcript, duration in seconds."""

    path: Path
    text: str
    duration: float


def _problem(path: Path) -> tuple[str | None, float]:
    """Why `path` cannot be used (None if it can), and its duration."""
    try:
        info = sf.info(str(path))
    except Exception as e:  # soundfile raises several types for missing, truncated or foreign files
        return f"unreadable ({type(e).__name__})", 0.0
    if info.frames == 0:
        return "empty", 0.0
    if info.channels != 1:
        return f"{info.channels} channels, expected mono", 0.0
    if info.subtype in ("FLOAT", "DOUBLE"):  # integer PCM cannot hold NaN or inf
        data, _ = sf.read(str(path), dtype="float32")
        if not np.isfinite(data).all():
            return "NaN or infinite samples", 0.0
    return None, info.frames / info.samplerate


def check_clips(clips: Sequence[Clip], split: str, *, max_duration: float | None = None) -> list[Clip]:
    """Clips whose audio is usable (and not longer than `max_duration`); stop if over 1% are bad."""
    good: list[Clip] = []
    bad: list[tuple[Path, str]] = []
    too_long = 0
    for clip in clips:
        problem, duration = _problem(clip.path)
        if problem:
            bad.append((clip.path, problem))
        elif not clip.text:
            bad.append((clip.path, "empty transcript"))
        elif max_duration is not None and duration > max_duration:
            too_long += 1
        else:
            good.append(Clip(clip.path, clip.text, duration))
    if bad:
        examples = "; ".join(f"{p} ({why})" for p, why in bad[:3])
        msg = f"{len(bad)} of {len(clips)} clips in split '{split}' are bad audio, e.g. {examples}"
        if len(bad) > MAX_BAD_FRACTION * len(clips):
            raise DataError(f"{msg}; more than {MAX_BAD_FRACTION:.0%}: fix or remove them")
        log.warning("skipped %s", msg)
        for p, why in bad:
            log.info("skipped %s (%s)", p, why)
    if too_long:
        log.info("split '%s': dropped %d clips longer than %.1f s", split, too_long, max_duration)
    if not good:
        raise DataError(f"split '{split}' has no usable clips")
    return good


class SpeechDataset(Dataset):
    """Clips -> (waveform float32 (S,), character ids int64 (L,)) at `sample_rate`."""

    def __init__(self, clips: Sequence[Clip], *, sample_rate: int = 16_000) -> None:
        """`clips` should come from `check_clips`."""
        self.clips = list(clips)
        self.sample_rate = sample_rate
        self.tokenizer = CharTokenizer()

    def __len__(self) -> int:
        return len(self.clips)

    @property
    def durations(self) -> list[float]:
        """Seconds per clip (for length bucketing)."""
        return [c.duration for c in self.clips]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        clip = self.clips[i]
        try:
            data, rate = sf.read(str(clip.path), dtype="float32", always_2d=True)
        except Exception as e:
            raise DataError(
                f"cannot read {clip.path} ({type(e).__name__}); it passed the start-up check"
            ) from e
        wav = torch.from_numpy(data[:, 0].copy())
        if rate != self.sample_rate:
            wav = AF.resample(wav, rate, self.sample_rate)
        return wav, torch.tensor(self.tokenizer.encode(clip.text), dtype=torch.long)


def collate_speech(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Zero-pad waveforms and targets into a batch dict of tensors (and their lengths)."""
    waves, targets = zip(*items, strict=True)
    return {
        "audio": torch.nn.utils.rnn.pad_sequence(waves, batch_first=True),
        "audio_lengths": torch.tensor([len(w) for w in waves]),
        "targets": torch.nn.utils.rnn.pad_sequence(targets, batch_first=True),
        "target_lengths": torch.tensor([len(t) for t in targets]),
    }


def read_manifest(path: str | Path) -> list[Clip]:
    """Clips of a NeMo-style JSONL manifest; relative audio paths resolve against the manifest's folder."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"manifest {path} does not exist; point data.train/data.val at JSONL manifests")
    clips = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                audio = Path(row["audio_filepath"]).expanduser()
                text = row["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(
                    f"{path}:{n} is not a manifest row with audio_filepath and text ({type(e).__name__}: {e})"
                ) from None
            clips.append(
                Clip(audio if audio.is_absolute() else path.parent / audio, normalize_transcript(text), 0.0)
            )
    return clips


def read_librispeech(root: str | Path, subset: str) -> list[Clip]:
    """Clips of one LibriSpeech subset (SUBSET/SPEAKER/CHAPTER/*.trans.txt + .flac), without downloading."""
    root = Path(root).expanduser()
    folder = next((d for d in (root / subset, root / "LibriSpeech" / subset) if d.is_dir()), None)
    if folder is None:
        raise DataError(
            f"LibriSpeech subset '{subset}' not found under {root} (looked for {root / subset} and "
            f"{root / 'LibriSpeech' / subset}); set data.root to the folder holding it"
        )
    clips = []
    for trans in sorted(folder.glob("*/*/*.trans.txt")):
        for line in trans.read_text().splitlines():
            if line.strip():
                uid, _, text = line.partition(" ")
                clips.append(Clip(trans.parent / f"{uid}.flac", normalize_transcript(text), 0.0))
    if not clips:
        raise DataError(f"no transcripts (*/*/*.trans.txt) in {folder}; is it a LibriSpeech subset?")
    return clips


@DATASETS.register("espeak_words")
def espeak_words(
    *,
    seed: Annotated[int, Bounds(ge=0)] = 0,
    train_size: Annotated[int, Bounds(ge=1)] = 3000,
    val_size: Annotated[int, Bounds(ge=1)] = 200,
    test_size: Annotated[int, Bounds(ge=1)] = 200,
    eval_split: Annotated[str, Bounds(choices=("val", "test"))] = "val",
    sample_rate: Annotated[int, Bounds(ge=1)] = 16_000,
) -> tuple[SpeechDataset, SpeechDataset]:
    """The embedded corpus (generated with eSpeak NG on first use, then cached): (train, eval_split)."""
    root = ensure_corpus(seed, {"train": train_size, "val": val_size, "test": test_size})
    train = check_clips(read_manifest(root / "train.jsonl"), "train")
    held_out = check_clips(read_manifest(root / f"{eval_split}.jsonl"), eval_split)
    return SpeechDataset(train, sample_rate=sample_rate), SpeechDataset(held_out, sample_rate=sample_rate)


@DATASETS.register("librispeech")
def librispeech(
    *,
    root: str | None = None,
    subsets: list[str] = ["train-clean-100"],  # noqa: B006 - read only; the schema needs a plain default
    val_subsets: list[str] = ["dev-clean"],  # noqa: B006
    max_duration: Annotated[float, Bounds(gt=0)] = 20.0,
    sample_rate: Annotated[int, Bounds(ge=1)] = 16_000,
) -> tuple[SpeechDataset, SpeechDataset]:
    """LibriSpeech from a local folder: (train subsets, validation subsets)."""
    if not root:
        raise ConfigError(
            "data.root is required for LibriSpeech: data.root=DIR (the folder holding the subsets)"
        )
    train = [c for s in subsets for c in read_librispeech(root, s)]
    val = [c for s in val_subsets for c in read_librispeech(root, s)]
    train = check_clips(train, "+".join(subsets), max_duration=max_duration)
    val = check_clips(val, "+".join(val_subsets))
    return SpeechDataset(train, sample_rate=sample_rate), SpeechDataset(val, sample_rate=sample_rate)


@DATASETS.register("manifest")
def manifest(
    *,
    train: str | None = None,
    val: str | None = None,
    max_duration: Annotated[float, Bounds(gt=0)] = 20.0,
    sample_rate: Annotated[int, Bounds(ge=1)] = 16_000,
) -> tuple[SpeechDataset, SpeechDataset]:
    """NeMo-style JSONL manifests (audio_filepath, text[, duration]): (train, val)."""
    if not train or not val:
        raise ConfigError("data=manifest needs data.train=FILE and data.val=FILE (JSONL manifests)")
    tr = check_clips(read_manifest(train), "train", max_duration=max_duration)
    va = check_clips(read_manifest(val), "val")
    return SpeechDataset(tr, sample_rate=sample_rate), SpeechDataset(va, sample_rate=sample_rate)
