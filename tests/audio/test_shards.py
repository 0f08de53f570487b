"""audio.shards: LibriSpeech trees and manifests written into tar shards read back clip for clip as the folder
reads, an ASR run trains from them (a window of shards at a time, on the whole set's duration buckets), and a
damaged or mismatched shard is counted or refused as the issue asks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from audio.datasets import librispeech, manifest
from audio.shards import speech_shards
from core.data.bad_samples import BadSamplePolicy
from recipes.prepare import main as prepare_main
from tests.helpers import ASR, cli_env, read_metrics, train

SUBSETS = (("train-clean-100", "19", 24), ("dev-clean", "84", 6))


@pytest.fixture
def libri(tmp_path: Path) -> Path:
    """A LibriSpeech tree of tones 1.0-2.4 s long (a third of them 48 kHz wav-in-flac: resampled on read)."""
    root = tmp_path / "LibriSpeech"
    rng = np.random.default_rng(0)
    for subset, spk, n in SUBSETS:
        chapter = root / subset / spk / "198"
        chapter.mkdir(parents=True)
        lines = []
        for u in range(n):
            uid, rate = f"{spk}-198-{u:04d}", 48_000 if u % 3 == 0 else 16_000
            t = np.arange(int((1.0 + 0.2 * (u % 8)) * rate)) / rate
            wav = 0.1 * np.sin(2 * np.pi * (200 + 40 * u) * t) + 0.01 * rng.standard_normal(len(t))
            sf.write(chapter / f"{uid}.flac", wav, rate)
            lines.append(f"{uid} SAY {u} TIMES")
        (chapter / f"{spk}-198.trans.txt").write_text("\n".join(lines) + "\n")
    return root


def prepared(libri: Path, out: Path, *extra: str) -> Path:
    code = prepare_main(
        ["+task=asr", f"data.root={libri}", f"out={out}", "shard_mb=0.1", "progress=false", *extra]
    )
    assert code == 0
    return out


def same_items(a: torch.utils.data.Dataset, b: torch.utils.data.Dataset) -> None:
    assert len(a) == len(b) > 0
    for i in range(len(a)):
        (wa, ta), (wb, tb) = a[i], b[i]
        assert torch.equal(wa, wb) and torch.equal(ta, tb), i


def test_shards_read_back_clip_for_clip_as_the_folder_and_its_manifest(libri: Path, tmp_path: Path) -> None:
    out = prepared(libri, tmp_path / "shards")
    m = json.loads((out / "manifest.json").read_text())
    assert m["kind"] == "speech" and len(m["splits"]["train"]["shards"]) > 2
    train, val = speech_shards(path=str(out))
    want_train, want_val = librispeech(root=str(libri), max_duration=20.0)
    assert [c.text for c in train.clips] == [c.text for c in want_train.clips]
    assert train.durations == want_train.durations and len(set(train.shard_of)) > 2
    same_items(train, want_train)
    same_items(val, want_val)
    # the same clips from JSONL manifests, prepared by the same command
    for split, subset in (("train", "train-clean-100"), ("val", "dev-clean")):
        rows = [
            {"audio_filepath": str(p), "text": f"say {int(p.stem[-4:])} times"}
            for p in sorted((libri / subset).rglob("*.flac"))
        ]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = prepare_main(
        [
            "+task=asr",
            f"data.train={tmp_path / 'train.jsonl'}",
            f"data.val={tmp_path / 'val.jsonl'}",
            f"out={tmp_path / 'from_manifest'}",
            "progress=false",
        ]
    )
    assert code == 0
    m_train, _ = speech_shards(path=str(tmp_path / "from_manifest"))
    same_items(m_train, manifest(train=str(tmp_path / "train.jsonl"), val=str(tmp_path / "val.jsonl"))[0])


SHARD_RUN = [*ASR[:1], *ASR[5:], "trainer=smoke", "data=speech_shards", "trainer.batch_size=4"]


@pytest.mark.slow  # a whole run (default suite time)
def test_an_asr_run_trains_from_shards_and_counts_a_cut_shards_lost_clips(
    libri: Path, tmp_path: Path
) -> None:
    out = prepared(libri, tmp_path / "shards")
    m = json.loads((out / "manifest.json").read_text())
    shard = m["splits"]["train"]["shards"][0]
    index = json.loads((out / shard["index"]).read_text())
    os.truncate(out / shard["file"], index[-2]["members"]["flac"][0] + 100)  # the last two clips are cut
    run = train(
        tmp_path / "run",
        [*SHARD_RUN, f"data.path={out}", "data.max_bad_fraction=0.2", "trainer.num_workers=2"],
    )
    rows = read_metrics(run)
    assert sum(1 for r in rows if "train/loss" in r) == 5
    counts = [r["data/bad_samples"] for r in rows if "data/bad_samples" in r]
    assert counts and max(counts) == 2  # the two clips whose bytes the cut removed


@pytest.mark.slow  # a process of its own: the start's imports cost ~5 s
def test_a_shard_that_does_not_match_its_manifest_is_one_line_exit_2(libri: Path, tmp_path: Path) -> None:
    out = prepared(libri, tmp_path / "shards")
    with (out / "val-00000.tar").open("ab") as f:
        f.write(b"\0" * 1024)  # another prepare's shard, or one appended to
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes.train",
            *SHARD_RUN,
            f"data.path={out}",
            f"hydra.run.dir={tmp_path / 'r'}",
        ],
        env=cli_env({"TORCHKILN_CACHE": str(tmp_path / "cache")}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(out / "val-00000.tar") in lines[0] and "Traceback" not in r.stderr


def test_bad_clips_are_left_out_of_the_shards_named_in_the_manifest(libri: Path, tmp_path: Path) -> None:
    bad = libri / "train-clean-100" / "19" / "198" / "19-198-0004.flac"
    bad.write_bytes(b"not audio")
    out = prepared(libri, tmp_path / "shards", "data.max_bad_fraction=0.1")
    m = json.loads((out / "manifest.json").read_text())
    assert [b["where"] for b in m["bad_samples"]] == [str(bad)]
    assert m["splits"]["train"]["samples"] == SUBSETS[0][2] - 1
    train, _ = speech_shards(path=str(out), policy=BadSamplePolicy())
    assert "SAY 4 TIMES".lower() not in [c.text for c in train.clips]
