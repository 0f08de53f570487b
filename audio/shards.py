"""Speech in tar shards (`core.data.sample_shards`): LibriSpeech trees and JSONL manifests written once by
`python -m recipes.prepare +task=asr`, then trained from with `data=speech_shards data.path=SHARDS`.

Each clip is stored as its source file's bytes (`KEY.flac`, `KEY.wav`, ...: nothing is re-encoded, so a
clip reads back sample for sample) beside `KEY.json` (transcript and duration, WebDataset's convention for
metadata). The index holds each clip's duration and normalised transcript, so the duration buckets, the
tokenizer and the too-fast and too-long checks work before any audio is read, as they do on a folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from audio.ctc import normalize_transcript
from audio.datasets import (
    Clip,
    SpeechDataset,
    _problem,
    duration_batches,
    read_librispeech,
    read_manifest,
)
from core.bounds import Bounds
from core.data.bad_samples import DEFAULT_POLICY, BadSamplePolicy, BadSamples
from core.data.sample_shards import SampleShards, file_stamp, prepare_samples
from core.data.samplers import LengthBucketBatchSampler, ShardWindowBatchSampler
from core.errors import ConfigError, DataError
from core.registry import DATASETS

KIND = "speech"


def load_clip(item: tuple[str, str, str]) -> tuple[dict[str, bytes], dict[str, Any]] | str:
    """One clip for a shard: (members, index facts), or why it is bad (the checks a folder's run makes when
    it starts: unreadable, empty, truncated, multi-channel, too short, non-finite; an empty transcript)."""
    path, text, source = item
    problem, duration = _problem(Path(path))
    if problem:
        return problem
    if not text:
        return "empty transcript"
    try:
        audio = Path(path).read_bytes()
    except OSError as e:
        return f"unreadable ({e.strerror})"
    facts = {"text": text, "duration": duration, "source": source}
    ext = Path(path).suffix.lstrip(".").lower() or "wav"
    return {ext: audio, "json": json.dumps(facts).encode()}, facts


def _describe(item: tuple[str, str, str]) -> str:
    return item[0]


def speech_sources(
    root: str, subsets: list[str], val_subsets: list[str], train: str, val: str
) -> dict[str, list[tuple[str, str, str]]]:
    """(audio file, normalised transcript, where it came from) per split: LibriSpeech subsets under `root`,
    or the `train`/`val` JSONL manifests."""
    if train or val:
        if not (train and val):
            missing = "data.val" if train else "data.train"
            raise ConfigError(
                f"speech from manifests needs data.train=FILE and data.val=FILE; set {missing}",
                key=missing,
                value="",
                valid=("a JSONL manifest",),
            )
        splits = {"train": read_manifest(train), "val": read_manifest(val)}
        bases = {"train": Path(train).expanduser().parent, "val": Path(val).expanduser().parent}
    else:
        if not root or not Path(root).expanduser().is_dir():
            raise DataError(
                f"data.root={root!r} is not a folder; point it at the folder holding the LibriSpeech subsets "
                "(or give data.train=FILE data.val=FILE manifests)",
                key="data.root",
                value=str(root),
                valid=("a LibriSpeech folder",),
            )
        splits = {
            "train": [c for s in subsets for c in read_librispeech(root, s)],
            "val": [c for s in val_subsets for c in read_librispeech(root, s)],
        }
        base = Path(root).expanduser()
        bases = {"train": base, "val": base}
    out = {}
    for split, clips in splits.items():
        out[split] = [(str(c.path), c.text, _relative(c.path, bases[split])) for c in clips]
    return out


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def prepare_speech(
    out: str,
    sources: dict[str, list[tuple[str, str, str]]],
    *,
    shard_mb: float = 256,
    workers: int = 0,
    policy: BadSamplePolicy = DEFAULT_POLICY,
    progress: bool = True,
) -> dict[str, Any]:
    """Write the clips of `sources` (`speech_sources`) into speech shards in `out`; the manifest."""
    inputs = {
        "shard_mb": shard_mb,
        "splits": {s: [[src, text, file_stamp(p)] for p, text, src in items] for s, items in sources.items()},
    }
    return prepare_samples(
        out,
        kind=KIND,
        splits=sources,
        load=load_clip,
        describe=_describe,
        inputs=inputs,
        shard_bytes=int(shard_mb * 2**20),
        workers=workers,
        policy=policy,
        progress=progress,
        noun="clips",
    )


def shard_clips(
    shards: SampleShards, split: str, policy: BadSamplePolicy, max_duration: float | None = None
) -> tuple[list[Clip], BadSamples]:
    """The clips of one split of a speech shard folder (those longer than `max_duration` left out) and the
    bad ones found (a shard cut short), as `audio.datasets.check_clips` gives a folder's."""
    bad = BadSamples(policy, f"split '{split}' of {shards.root}", "clips")
    samples = shards.samples(split, bad)
    clips = []
    for s in samples:
        ext = next(e for e in s.members if e != "json")
        duration = float(s.facts["duration"])
        if max_duration is None or duration <= max_duration:
            clips.append(Clip(Path(s.where), normalize_transcript(s.facts["text"]), duration, s.members[ext]))
    bad.check(len(samples) + len(bad.found))
    if not clips:
        raise DataError(f"split '{split}' of {shards.root} has no usable clips")
    return clips, bad


@DATASETS.register("speech_shards")
def speech_shards(
    *,
    path: Annotated[str, Bounds(exists="dir")] = "",
    max_duration: Annotated[float, Bounds(gt=0)] = 20.0,
    sample_rate: Annotated[int, Bounds(ge=1)] = 16_000,
    window_shards: Annotated[int, Bounds(ge=1)] = 4,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> tuple[SpeechDataset, SpeechDataset]:
    """Speech shards written by `python -m recipes.prepare +task=asr`: (train, val).

    path: the prepared folder (required)
    max_duration: longest training clip kept, in seconds (longer ones are left out)
    sample_rate: Hz the audio is resampled to when read
    window_shards: shards an epoch reads at a time (their clips are shuffled and bucketed together)
    """
    if not path:
        raise ConfigError(
            "data=speech_shards needs data.path=DIR, a folder python -m recipes.prepare +task=asr wrote",
            key="data.path",
            value="",
            valid=("DIR",),
        )
    shards = SampleShards(path, KIND)
    train = shard_clips(shards, "train", policy, max_duration)
    val = shard_clips(shards, "val", policy)
    return tuple(  # type: ignore[return-value]
        SpeechDataset(clips, sample_rate=sample_rate, bad=bad, window_shards=window_shards)
        for clips, bad in (train, val)
    )


def speech_batches(
    dataset: SpeechDataset,
    batch_size: int,
    *,
    train: bool,
    seed: int,
    num_buckets: int,
    batch_duration: float,
    window: int | None = None,
) -> LengthBucketBatchSampler | ShardWindowBatchSampler:
    """Batches of similar duration (`audio.datasets.duration_batches`); clips in shards are batched a window
    of `window` shards at a time (default: the dataset's window_shards), on the whole set's buckets."""
    durations = dataset.durations
    settings = {"num_buckets": num_buckets, "batch_duration": batch_duration}
    whole = duration_batches(durations, batch_size, train=train, seed=seed, **settings)
    shard_of = getattr(dataset, "shard_of", None)  # a task's own dataset may read no shards
    if shard_of is None:
        return whole

    def window_batches(idx: list[int], window_seed: int) -> LengthBucketBatchSampler:
        return duration_batches(
            [durations[i] for i in idx],
            batch_size,
            train=train,
            seed=window_seed,
            boundaries=whole.boundaries,
            **settings,
        )

    window = dataset.window_shards if window is None else window
    return ShardWindowBatchSampler(
        shard_of, window_batches, window=window, shuffle=train, seed=seed, whole=whole
    )
