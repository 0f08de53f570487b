"""Speech datasets: the embedded corpora (eSpeak NG's 115 words, several engines' voices), LibriSpeech folders
and NeMo-style JSONL manifests.

Every source becomes a list of `Clip`s, checked up front from each file's header (unreadable, empty,
truncated, multi-channel, too short or non-finite audio), then a `SpeechDataset` that reads audio with
soundfile and resamples with torchaudio; a clip that fails to decode or is silent is found when it is read.
Bad clips follow the run's bad-sample policy (`core.data.bad_samples`): skipped and named, or a one-line stop.
"""

from __future__ import annotations

import io
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF
from torch.utils.data import Dataset

from audio.augment import speed_perturb, speed_rates
from audio.corpus import ensure_corpus
from audio.ctc import CharTokenizer, SubwordTokenizer, frames_needed, normalize_transcript
from audio.voices_corpus import TEXTS, VAL_SPEAKERS, ensure_voices, resolve_voices
from core.bounds import Bounds
from core.data.bad_samples import DEFAULT_POLICY, BadSample, BadSamplePolicy, BadSamples
from core.data.jsonl import jsonl_lines
from core.data.sample_shards import MemberRef, read_member
from core.data.samplers import LengthBucketBatchSampler
from core.errors import ConfigError, DataError
from core.registry import DATASETS

log = logging.getLogger(__name__)

#: Shortest usable clip: below 0.1 s there is no spoken syllable to learn from, and the features hold fewer
#: than ten 10 ms frames (two or three after the Conformer's 4x subsampling)
MIN_SECONDS = 0.1
#: A clip whose loudest sample is below this (about 3 steps of 16-bit PCM) is silence
SILENCE_PEAK = 1e-4


@dataclass(frozen=True)
class Clip:
    """One utterance: audio file, normalised transcript, duration in seconds; a clip read from a tar shard
    (`audio.shards`) has its bytes' place there, and `path` only names it (`SHARD.tar:KEY`)."""

    path: Path
    text: str
    duration: float
    shard: MemberRef | None = None


def _wav_frames_missing(path: Path, block_align: int) -> int:
    """Frames a WAV file's header promises beyond what the file holds (0 if complete, or not a WAV):
    libsndfile silently shortens such a file to what is there."""
    with open(path, "rb") as f:
        head = f.read(12)
        if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return 0
        size = path.stat().st_size
        while chunk := f.read(8):
            if len(chunk) < 8:
                return 0
            name, length = chunk[:4], struct.unpack("<I", chunk[4:])[0]
            if name == b"data":
                if length in (0, 0xFFFFFFFF):  # a streaming writer's "unknown length"
                    return 0
                return max(0, length - (size - f.tell())) // max(block_align, 1)
            f.seek(length + length % 2, 1)
    return 0


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
    width = {"PCM_U8": 1, "PCM_S8": 1, "PCM_16": 2, "PCM_24": 3, "PCM_32": 4, "FLOAT": 4, "DOUBLE": 8}
    missing = _wav_frames_missing(path, width.get(info.subtype, 0)) if info.format == "WAV" else 0
    if missing:
        return f"truncated: the header promises {missing} more frames than the file holds", 0.0
    duration = info.frames / info.samplerate
    if duration < MIN_SECONDS:
        return f"{duration:.3f} s, shorter than {MIN_SECONDS} s", 0.0
    if info.subtype in ("FLOAT", "DOUBLE"):  # integer PCM cannot hold NaN or inf
        data, _ = sf.read(str(path), dtype="float32")
        if not np.isfinite(data).all():
            return "NaN or infinite samples", 0.0
    return None, duration


def check_clips(
    clips: Sequence[Clip],
    split: str,
    *,
    max_duration: float | None = None,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> tuple[list[Clip], BadSamples]:
    """The usable clips (not longer than `max_duration`) and the bad ones found, which go by `policy`; read
    the clips through `SpeechDataset(clips, bad=...)`, which finds the rest while loading."""
    good: list[Clip] = []
    bad = BadSamples(policy, f"split '{split}'", "clips")
    too_long = 0
    for clip in clips:
        problem, duration = _problem(clip.path)
        if problem:
            bad.add(str(clip.path), problem)
        elif not clip.text:
            bad.add(str(clip.path), "empty transcript")
        elif max_duration is not None and duration > max_duration:
            too_long += 1
        else:
            good.append(Clip(clip.path, clip.text, duration))
    bad.check(len(good) + len(bad.found))  # clips dropped for length are neither bad nor kept
    if too_long:
        log.info("split '%s': dropped %d clips longer than %.1f s", split, too_long, max_duration)
    if not good:
        raise DataError(f"split '{split}' has no usable clips")
    return good, bad


class SpeechDataset(Dataset):
    """Clips -> (waveform float32 (S,), character ids int64 (L,)) at `sample_rate`, each clip played at a
    speed drawn from `speed_perturb` (torch's global generator, which the trainer seeds per sample)."""

    def __init__(
        self,
        clips: Sequence[Clip],
        *,
        sample_rate: int = 16_000,
        bad: BadSamples | None = None,
        speed_perturb: Sequence[float] = (),
        tokenizer: CharTokenizer | SubwordTokenizer | None = None,
        window_shards: int = 1,
    ) -> None:
        """`clips` and `bad` should come from `check_clips` (without `bad`: the default policy); an empty
        `speed_perturb` reads every clip as it is; `tokenizer` encodes the targets (default: characters);
        `window_shards`: for clips in shards, how many shards an epoch reads at a time."""
        self.clips = list(clips)
        self.window_shards = window_shards
        self.sample_rate = sample_rate
        # a list of factors that all play at normal speed (after rounding) perturbs nothing
        rates = [speed_rates(f) for f in speed_perturb]
        self.speed_perturb = tuple(speed_perturb) if any(a != b for a, b in rates) else ()
        self._slowest = min((a / b for a, b in rates), default=1.0)  # the factor as rounded for resampling
        self.tokenizer = CharTokenizer() if tokenizer is None else tokenizer
        if bad is None:
            bad = BadSamples(DEFAULT_POLICY, "the clips given", "clips")
            bad.check(len(self.clips))
        self.bad = bad

    def __len__(self) -> int:
        return len(self.clips)

    @property
    def durations(self) -> list[float]:
        """Seconds per clip (for length bucketing); with speed perturbation, the longest a clip comes out."""
        if not self.speed_perturb:
            return [c.duration for c in self.clips]
        # each resampling (file rate, then speed) rounds its length up: the first's extra sample is stretched
        extra = (1 / self._slowest + 1) / self.sample_rate
        return [c.duration / self._slowest + extra for c in self.clips]

    @property
    def shard_of(self) -> list[int] | None:
        """The shard each clip lies in (numbered in order of appearance), or None for clips in files."""
        if not self.clips or self.clips[0].shard is None:
            return None
        numbers: dict[str, int] = {}
        return [numbers.setdefault(c.shard.shard, len(numbers)) for c in self.clips]  # type: ignore[union-attr]

    def describe(self, i: int) -> str:
        """The audio file of clip `i`."""
        return str(self.clips[i].path)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.bad.load(i, self._read, self.describe)

    def _read(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        clip = self.clips[i]
        source = io.BytesIO(read_member(clip.shard)) if clip.shard is not None else str(clip.path)
        try:
            data, rate = sf.read(source, dtype="float32", always_2d=True)
        except Exception as e:  # e.g. a FLAC cut short: its header passed the start-up check
            raise BadSample(f"unreadable ({type(e).__name__}: {str(e).splitlines()[0]})") from None
        expected = round(clip.duration * rate)  # the start-up check read the duration from the header
        if len(data) < expected:
            raise BadSample(f"truncated: {len(data)} of the header's {expected} frames decode")
        # found here rather than at start-up: it needs every sample decoded, which reading does anyway
        if float(np.abs(data[:, 0]).max()) < SILENCE_PEAK:
            raise BadSample(f"silent (no sample above {SILENCE_PEAK:g})")
        wav = torch.from_numpy(data[:, 0].copy())
        if rate != self.sample_rate:
            wav = AF.resample(wav, rate, self.sample_rate)
        if self.speed_perturb:
            factor = self.speed_perturb[int(torch.randint(len(self.speed_perturb), ()))]
            wav = speed_perturb(wav, factor)
        return wav, torch.tensor(self.tokenizer.encode(clip.text), dtype=torch.long)


def without_unalignable(ds: SpeechDataset, output_frames: Callable[[int], int]) -> SpeechDataset:
    """`ds` without the clips too fast for the model: a transcript needing more CTC frames (a label each, a
    blank between equal neighbours) than `output_frames` (waveform samples -> model frames) gives the clip
    at its fastest speed perturbation. They go to `ds.bad`, named and counted under its policy, instead of
    training at a loss CTC's `zero_infinity` silently zeroes."""
    fastest = max((a / b for a, b in (speed_rates(f) for f in ds.speed_perturb)), default=1.0)

    def why(clip: Clip) -> str | None:
        samples = int(round(clip.duration * ds.sample_rate) / fastest)
        have, need = output_frames(samples), frames_needed(ds.tokenizer.encode(clip.text))
        return f"too fast for the model: {need} CTC labels in {have} output frames" if have < need else None

    return _without(ds, why, "slow enough for the model's output frames")


def without_unfit(ds: SpeechDataset, max_samples: int, max_tokens: int) -> SpeechDataset:
    """`ds` without the clips a sequence-to-sequence model cannot take: longer than `max_samples` (Whisper's
    30 s window) or with more than `max_tokens` target tokens. They go to `ds.bad`, named and counted under
    its policy, as too-fast clips do for CTC."""

    def why(clip: Clip) -> str | None:
        if int(round(clip.duration * ds.sample_rate)) > max_samples:
            return f"{clip.duration:.1f} s: longer than the model's {max_samples / ds.sample_rate:.0f} s"
        tokens = len(ds.tokenizer.encode(clip.text))
        return (
            f"{tokens} transcript tokens: more than the model's {max_tokens}" if tokens > max_tokens else None
        )

    return _without(ds, why, "the model can take (see the rejected clips above)")


def _without(ds: SpeechDataset, why: Callable[[Clip], str | None], none_left: str) -> SpeechDataset:
    """`ds` without the clips `why` gives a reason for, which go to `ds.bad` with it; a DataError saying
    there is no clip `none_left` when none is kept."""
    kept: list[Clip] = []
    found: list[tuple[str, str]] = []
    for clip in ds.clips:
        reason = why(clip)
        if reason is None:
            kept.append(clip)
        else:
            found.append((str(clip.path), reason))
    ds.bad.reject(found)
    if not found:
        return ds
    if not kept:
        raise DataError(f"{ds.bad.source} has no clip {none_left}")
    return SpeechDataset(
        kept,
        sample_rate=ds.sample_rate,
        bad=ds.bad,
        speed_perturb=ds.speed_perturb,
        tokenizer=ds.tokenizer,
        window_shards=ds.window_shards,
    )


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
    return [Clip(audio, normalize_transcript(text), 0.0) for audio, text in manifest_rows(path)]


def manifest_rows(path: str | Path, *, need_text: bool = True) -> list[tuple[Path, str | None]]:
    """(audio file, transcript as written) of each row of a NeMo-style JSONL manifest; relative audio paths
    resolve against the manifest's folder. Without `need_text`, a row may lack its transcript (None)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(
            f"manifest {path} does not exist; give a JSONL manifest (audio_filepath, text)",
            key="manifest",
            value=str(path),
            valid=("a JSONL manifest (audio_filepath, text)",),
        )
    fields = "audio_filepath and text" if need_text else "audio_filepath"
    try:
        lines = list(jsonl_lines(path))
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read manifest {path} ({type(e).__name__}: {e})") from None
    rows: list[tuple[Path, str | None]] = []
    for n, row, why in lines:
        try:
            if row is None:  # not a JSON object: named as a row without the fields
                raise ValueError(why)
            audio = Path(row["audio_filepath"]).expanduser()
            text = row["text"] if need_text else row.get("text")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"text is a {type(text).__name__}, not a string")
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"{path}:{n} is not a manifest row with {fields} ({type(e).__name__}: {e})",
                key="manifest",
                value=f"{path}:{n}",
                valid=(fields,),
            ) from None
        rows.append((audio if audio.is_absolute() else path.parent / audio, text))
    return rows


#: what `audio_files` takes for an audio file
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")


def audio_files(source: Path) -> list[Path]:
    """`source` if it is a file, else every audio file under it (recursively, sorted); a missing source or a
    folder without audio is a one-line DataError."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise DataError(f"{source} does not exist; give an audio file, a folder of them or a JSONL manifest")
    found = sorted(p for p in source.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file())
    if not found:
        raise DataError(f"{source}: no audio files ({', '.join(AUDIO_SUFFIXES)}) under it")
    return found


def read_audio(path: Path, sample_rate: int) -> torch.Tensor:
    """The mono waveform (S,) of the audio file at `path` at `sample_rate` (a stereo file is mixed down
    rather than refused); a file that does not decode or holds no samples is a one-line DataError."""
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as e:  # soundfile raises several types for missing or foreign files
        raise DataError(
            f"cannot read {path} as audio ({type(e).__name__}); give a wav or flac file"
        ) from None
    if data.shape[0] == 0:
        raise DataError(f"{path} holds no samples")
    wav = torch.from_numpy(data.mean(axis=1))
    return AF.resample(wav, rate, sample_rate) if rate != sample_rate else wav


def read_librispeech(root: str | Path, subset: str) -> list[Clip]:
    """Clips of one LibriSpeech subset (SUBSET/SPEAKER/CHAPTER/*.trans.txt + .flac), without downloading."""
    root = Path(root).expanduser()
    folder = next((d for d in (root / subset, root / "LibriSpeech" / subset) if d.is_dir()), None)
    if folder is None:
        raise DataError(
            f"LibriSpeech subset '{subset}' not found under {root} (looked for {root / subset} and "
            f"{root / 'LibriSpeech' / subset}); set data.root to the folder holding it",
            key="data.subsets",
            value=subset,
            valid=(str(root / subset), str(root / "LibriSpeech" / subset)),
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


def _datasets(
    train: tuple[list[Clip], BadSamples], val: tuple[list[Clip], BadSamples], sample_rate: int
) -> tuple[SpeechDataset, SpeechDataset]:
    """(train, val) datasets of two `check_clips` results."""
    (tc, tb), (vc, vb) = train, val
    return SpeechDataset(tc, sample_rate=sample_rate, bad=tb), SpeechDataset(
        vc, sample_rate=sample_rate, bad=vb
    )


@DATASETS.register("espeak_words")
def espeak_words(
    *,
    seed: Annotated[int, Bounds(ge=0)] = 0,
    train_size: Annotated[int, Bounds(ge=1)] = 3000,
    val_size: Annotated[int, Bounds(ge=1)] = 200,
    test_size: Annotated[int, Bounds(ge=1)] = 200,
    eval_split: Annotated[str, Bounds(choices=("val", "test"))] = "val",
    sample_rate: Annotated[int, Bounds(ge=1)] = 16_000,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> tuple[SpeechDataset, SpeechDataset]:
    """The embedded corpus (generated with eSpeak NG on first use, then cached): (train, eval_split).

    seed: seed of the generated corpus (another seed generates and caches another corpus)
    train_size: training utterances
    val_size: validation utterances (voices never heard in training)
    test_size: test utterances (other unheard voices)
    eval_split: the held-out split evaluated during training: val or test
    sample_rate: Hz the audio is resampled to when read
    """
    root = ensure_corpus(seed, {"train": train_size, "val": val_size, "test": test_size})
    train = check_clips(read_manifest(root / "train.jsonl"), "train", policy=policy)
    held_out = check_clips(read_manifest(root / f"{eval_split}.jsonl"), eval_split, policy=policy)
    return _datasets(train, held_out, sample_rate)


@DATASETS.register("voices")
def voices(
    *,
    engines: list[str] = [],  # noqa: B006 - read only; the schema needs a plain default
    test_engine: str = "auto",
    text: Annotated[str, Bounds(choices=TEXTS)] = "kjv",
    val_speakers: list[str] = list(VAL_SPEAKERS),  # noqa: B006, B008
    seed: Annotated[int, Bounds(ge=0)] = 0,
    train_size: Annotated[int, Bounds(ge=1)] = 3000,
    val_size: Annotated[int, Bounds(ge=1)] = 300,
    test_size: Annotated[int, Bounds(ge=1)] = 300,
    eval_split: Annotated[str, Bounds(choices=("val", "test_engine"))] = "val",
    sample_rate: Annotated[int, Bounds(ge=1)] = 16_000,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> tuple[SpeechDataset, SpeechDataset]:
    """The embedded multi-engine corpus (generated with the installed engines on first use, then cached):
    (train, eval_split). One log line names the engines it uses and those not installed.

    engines: the engines whose voices train (and speak in val), of espeak, flite, festival, piper; [] : every
        installed one but the test engine (a named one that is not installed is an error)
    test_engine: the engine only test_engine speaks in: auto (piper where installed and another engine is
        left to train on, else none), none, or an engine's name
    text: kjv (runs of 3-10 words of King James Bible verses, thousands of distinct words) or words115 (the
        115-word preset's sequences)
    val_speakers: speakers whose voices speak only in val (besides 8 held-out eSpeak NG variants)
    seed: seed of the generated corpus (another seed generates and caches another corpus)
    train_size: training utterances
    val_size: validation utterances (held-out speakers of the training engines)
    test_size: test_engine utterances (the held-out engine's voices)
    eval_split: the held-out split evaluated during training: val or test_engine
    sample_rate: Hz the audio is resampled to when read
    """
    sizes = {"train": train_size, "val": val_size, "test_engine": test_size}
    settings, line = resolve_voices(
        seed, sizes, engines=engines, test_engine=test_engine, text=text, val_speakers=val_speakers
    )
    log.info("%s", line)
    if eval_split == "test_engine" and not settings.test_engine:
        raise DataError(
            "data.eval_split=test_engine but no engine is held out (data.test_engine=none, or one engine "
            "is installed); install one or evaluate val",
            key="data.eval_split",
            value=eval_split,
            valid=("val",),
        )
    root = ensure_voices(settings)
    train = check_clips(read_manifest(root / "train.jsonl"), "train", policy=policy)
    held_out = check_clips(read_manifest(root / f"{eval_split}.jsonl"), eval_split, policy=policy)
    return _datasets(train, held_out, sample_rate)


@DATASETS.register("librispeech")
def librispeech(
    *,
    root: Annotated[str | None, Bounds(exists="dir")] = None,
    subsets: list[str] = ["train-clean-100"],  # noqa: B006 - read only; the schema needs a plain default
    val_subsets: list[str] = ["dev-clean"],  # noqa: B006
    max_duration: Annotated[float, Bounds(gt=0)] = 20.0,
    sample_rate: Annotated[int, Bounds(ge=1)] = 16_000,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> tuple[SpeechDataset, SpeechDataset]:
    """LibriSpeech from a local folder: (train subsets, validation subsets).

    root: the folder holding the subsets (required)
    subsets: training subsets, e.g. [train-clean-100,train-clean-360]
    val_subsets: validation subsets
    max_duration: longest training clip kept, in seconds (longer ones are left out)
    sample_rate: Hz the audio is resampled to when read
    """
    if not root:
        raise ConfigError(
            "data.root is required for LibriSpeech: data.root=DIR (the folder holding the subsets)",
            key="data.root",
            value="",
            valid=("DIR",),
        )
    train = [c for s in subsets for c in read_librispeech(root, s)]
    val = [c for s in val_subsets for c in read_librispeech(root, s)]
    train = check_clips(train, "+".join(subsets), max_duration=max_duration, policy=policy)
    val = check_clips(val, "+".join(val_subsets), policy=policy)
    return _datasets(train, val, sample_rate)


@DATASETS.register("manifest")
def manifest(
    *,
    train: Annotated[str | None, Bounds(exists="file")] = None,
    val: Annotated[str | None, Bounds(exists="file")] = None,
    max_duration: Annotated[float, Bounds(gt=0)] = 20.0,
    sample_rate: Annotated[int, Bounds(ge=1)] = 16_000,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> tuple[SpeechDataset, SpeechDataset]:
    """NeMo-style JSONL manifests (audio_filepath, text[, duration]): (train, val).

    train: the training manifest (required)
    val: the validation manifest (required)
    max_duration: longest training clip kept, in seconds (longer ones are left out)
    sample_rate: Hz the audio is resampled to when read
    """
    if not train or not val:
        raise ConfigError(
            "data=manifest needs data.train=FILE and data.val=FILE (JSONL manifests)",
            key="data.train" if not train else "data.val",
            value="",
            valid=("FILE",),
        )
    tr = check_clips(read_manifest(train), "train", max_duration=max_duration, policy=policy)
    va = check_clips(read_manifest(val), "val", policy=policy)
    return _datasets(tr, va, sample_rate)


def duration_batches(
    durations: Sequence[float],
    batch_size: int,
    *,
    train: bool,
    seed: int,
    num_buckets: int,
    batch_duration: float,
    boundaries: Sequence[int] | None = None,
) -> LengthBucketBatchSampler:
    """Batches of similar duration (shuffled for training), bucketed on 10 ms frames: `batch_size` clips
    each, or with `batch_duration` S > 0 as many as keep clips x the longest within S seconds; `boundaries`
    (in frames) replaces the buckets drawn from these durations' quantiles."""
    frames = [int(d * 100) + 1 for d in durations]  # rounded up: the budget is never exceeded
    if not batch_duration:
        # at least ~4 batches per bucket: on a small set, 8 buckets would cut batches down to a few clips
        buckets = max(1, min(num_buckets, len(frames) // (4 * batch_size)))
        return LengthBucketBatchSampler(
            frames, batch_size, shuffle=train, seed=seed, num_buckets=buckets, boundaries=boundaries
        )
    budget = int(batch_duration * 100)
    longer = sum(n > budget for n in frames)
    if longer:
        log.info("task.batch_duration=%g: %d clips longer than that are a batch each", batch_duration, longer)
    per_batch = max(1, budget // max(1, sorted(frames)[len(frames) // 2]))  # clips of median length
    buckets = max(1, min(num_buckets, len(frames) // (4 * per_batch)))
    # trainer.batch_size does not cap the count: the duration decides it
    return LengthBucketBatchSampler(
        frames,
        max(1, len(frames)),
        shuffle=train,
        seed=seed,
        num_buckets=buckets,
        max_padded=budget,
        boundaries=boundaries,
    )
