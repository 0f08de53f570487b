"""Speech from tar shards against speech from a folder tree, in clips/s, side by side in one run (issue #40
point 5, last bullet).

    PYTHONPATH=. python -m bench.speech_shards [--clips 2000] [--workers 0,2] [--rounds 3]

A LibriSpeech-layout tree of --clips FLAC clips (tones with noise, 2-12 s at 16 kHz: LibriSpeech's range) is
generated into a temporary folder and prepared into shards with `python -m recipes.prepare +task=asr`'s
function (its MB/s is printed too). Then each source is read whole, as a training epoch reads it: the ASR
task's duration batches (`audio.shards.speech_batches`; over the shards, a window of 4 shards at a
time), a DataLoader with N workers, `SpeechDataset` decoding and resampling nothing
(16 kHz files). Each cell is the best of --rounds epochs, alternating folder and shards; where the kernel
lets root drop the page cache (/proc/sys/vm/drop_caches), cold-cache epochs of each are timed too (the cache
dropped before each), the case shards are for: a file opened per shard, not per clip.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from torch.utils.data import DataLoader

from audio.datasets import SpeechDataset, collate_speech, librispeech
from audio.shards import prepare_speech, speech_batches, speech_shards, speech_sources
from bench.data import drop_caches, host_facts


def write_tree(root: Path, clips: int, seed: int = 0) -> int:
    """A LibriSpeech tree of `clips` training clips (and 8 dev clips); its bytes."""
    rng = np.random.default_rng(seed)
    total = 0
    for subset, n in (("train-clean-100", clips), ("dev-clean", 8)):
        chapter = root / subset / "19" / "198"
        chapter.mkdir(parents=True, exist_ok=True)
        lines = []
        for u in range(n):
            seconds = float(rng.uniform(2, 12))
            t = np.arange(int(seconds * 16_000)) / 16_000
            wav = 0.1 * np.sin(2 * np.pi * rng.uniform(100, 800) * t) + 0.02 * rng.standard_normal(len(t))
            path = chapter / f"19-198-{u:05d}.flac"
            sf.write(path, wav.astype(np.float32), 16_000)
            total += path.stat().st_size
            lines.append(f"19-198-{u:05d} CLIP NUMBER {u}")
        (chapter / "19-198.trans.txt").write_text("\n".join(lines) + "\n")
    return total


def epoch_rate(ds: SpeechDataset, workers: int, batch: int = 8) -> float:
    """Clips/s of one epoch of `ds` in the ASR task's batches through a DataLoader of `workers` workers."""
    sampler = speech_batches(ds, batch, train=True, seed=0, num_buckets=8, batch_duration=0, window=4)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=collate_speech, num_workers=workers)
    start, n = time.perf_counter(), 0
    for b in loader:
        n += len(b["audio_lengths"])
    return n / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Generate, prepare, time; print the table; the figures."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clips", type=int, default=2000)
    p.add_argument("--workers", default="0,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shard-mb", type=float, default=64.0)
    p.add_argument("--no-cold", action="store_true", help="warm page cache only (leave the cache alone)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)  # the loader's work, not the decoder's threads, is measured
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="speech_shards_bench_") as tmp:
        root, shards = Path(tmp) / "LibriSpeech", Path(tmp) / "shards"
        size = write_tree(root, a.clips)
        sources = speech_sources(str(root), ["train-clean-100"], ["dev-clean"], "", "")
        start = time.perf_counter()
        prepare_speech(str(shards), sources, shard_mb=a.shard_mb, progress=False)
        out["prepare_mb_s"] = size / 2**20 / (time.perf_counter() - start)
        folder = librispeech(root=str(root), max_duration=20.0)[0]
        sharded = speech_shards(path=str(shards))[0]
        print(host_facts())
        print(f"{a.clips} clips, {size / 2**20:.0f} MB of FLAC; prepare: {out['prepare_mb_s']:.1f} MB/s")
        print("| workers | cache | folder clips/s | shards clips/s | shards / folder |")
        print("|---|---|---|---|---|")
        cold = not a.no_cold and drop_caches()
        for w in (int(x) for x in a.workers.split(",")):
            rates: dict[str, list[float]] = {"folder": [], "shards": []}
            for _ in range(a.rounds):
                for name, ds in (("folder", folder), ("shards", sharded)):
                    rates[name].append(epoch_rate(ds, w))
            f, s = max(rates["folder"]), max(rates["shards"])
            out[f"warm_w{w}"] = s / f
            print(f"| {w} | warm | {f:.0f} | {s:.0f} | {s / f:.2f}x |")
            if cold:
                cold_rates: dict[str, list[float]] = {"folder": [], "shards": []}
                for _ in range(a.rounds):
                    for name, ds in (("folder", folder), ("shards", sharded)):
                        drop_caches()
                        cold_rates[name].append(epoch_rate(ds, w))
                f, s = max(cold_rates["folder"]), max(cold_rates["shards"])
                out[f"cold_w{w}"] = s / f
                print(f"| {w} | cold | {f:.0f} | {s:.0f} | {s / f:.2f}x |")
        if not cold:
            print("(the page cache could not be dropped here: warm figures only)")
    return out


if __name__ == "__main__":
    main()
