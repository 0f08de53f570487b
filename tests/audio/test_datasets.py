"""LibriSpeech and manifest readers on tiny fixtures, bad-audio handling, and the bucketing sampler."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from audio.datasets import (
    Clip,
    SpeechDataset,
    check_clips,
    collate_speech,
    read_librispeech,
    read_manifest,
)
from core.data.bad_samples import BadSamplePolicy
from core.errors import ConfigError, DataError
from core.registry import DATASETS
from tests.helpers import fault


def _tone(path: Path, seconds: float, rate: int = 16_000, **kw) -> None:
    t = np.arange(int(seconds * rate)) / rate
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, 0.1 * np.sin(2 * np.pi * 440 * t), rate, **kw)


@pytest.fixture
def libri(tmp_path: Path) -> Path:
    """LibriSpeech/{train-clean-100,dev-clean}/SPK/CH/ with flac files and transcripts."""
    root = tmp_path / "LibriSpeech"
    for subset, spk in (("train-clean-100", "19"), ("dev-clean", "84")):
        chapter = root / subset / spk / "198"
        lines = []
        for u, sec in enumerate((0.5, 1.25)):
            uid = f"{spk}-198-{u:04d}"
            _tone(chapter / f"{uid}.flac", sec)
            lines.append(f"{uid} CHAPTER {u} OF MR. SMITH'S BOOK")
        (chapter / f"{spk}-198.trans.txt").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_librispeech_layout_is_read_without_download(libri: Path) -> None:
    clips = read_librispeech(libri, "train-clean-100")
    assert [c.path.name for c in clips] == ["19-198-0000.flac", "19-198-0001.flac"]
    assert clips[0].text == "chapter zero of mr smith's book"
    train, val = DATASETS.build("librispeech", root=str(libri / "LibriSpeech"))  # either folder works
    assert train.durations == [0.5, 1.25] and len(val) == 2
    wav, ids = train[1]
    assert wav.shape == (20_000,) and wav.dtype == torch.float32
    assert train.tokenizer.decode(ids.tolist()) == "chapter one of mr smith's book"


def test_librispeech_errors_name_the_fix(libri: Path) -> None:
    with pytest.raises(ConfigError) as e:
        DATASETS.build("librispeech")
    assert fault(e.value) == ("data.root", "", ("DIR",))
    with pytest.raises(DataError) as e:
        DATASETS.build("librispeech", root=str(libri), subsets=["train-other-500"])
    where = (str(libri / "train-other-500"), str(libri / "LibriSpeech" / "train-other-500"))
    assert fault(e.value) == ("data.subsets", "train-other-500", where)


def test_manifest_relative_and_absolute_paths_and_resampling(tmp_path: Path) -> None:
    _tone(tmp_path / "a" / "x.wav", 1.0, rate=8_000)
    _tone(tmp_path / "abs.flac", 0.5)
    rows = [
        {"audio_filepath": "a/x.wav", "text": "Turn LEFT", "duration": 1.0},
        {"audio_filepath": str(tmp_path / "abs.flac"), "text": "stop"},
    ]
    man = tmp_path / "m.jsonl"
    man.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    train, val = DATASETS.build("manifest", train=str(man), val=str(man))
    assert [c.text for c in train.clips] == ["turn left", "stop"]
    wav, _ = train[0]
    assert wav.shape == (16_000,)  # 1 s at 8 kHz resampled to 16 kHz
    batch = collate_speech([train[0], train[1]])
    assert batch["audio"].shape == (2, 16_000) and batch["audio_lengths"].tolist() == [16_000, 8_000]
    assert batch["targets"].shape == (2, 9) and batch["target_lengths"].tolist() == [9, 4]


def test_speed_perturbed_clips_fit_their_durations_and_follow_the_seed(tmp_path: Path) -> None:
    _tone(tmp_path / "a.wav", 1.0, rate=8_000)  # resampled to 16 kHz, then perturbed
    _tone(tmp_path / "b.flac", 0.37)
    rows = [{"audio_filepath": name, "text": "go"} for name in ("a.wav", "b.flac")]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain, _ = DATASETS.build("manifest", train=str(tmp_path / "m.jsonl"), val=str(tmp_path / "m.jsonl"))
    perturbed = SpeechDataset(plain.clips, bad=plain.bad, speed_perturb=(0.9, 1.0, 1.1))
    for i in range(len(plain)):
        lengths = set()
        for seed in range(20):
            torch.manual_seed(seed)
            wav, ids = perturbed[i]
            torch.manual_seed(seed)
            assert torch.equal(perturbed[i][0], wav)  # the trainer seeds each sample: the same clip again
            assert torch.equal(ids, plain[i][1])
            lengths.add(len(wav))
            # bucketing reads `durations`: no perturbed clip has more 10 ms feature frames than they promise
            assert len(wav) // 160 + 1 <= int(perturbed.durations[i] * 100) + 1
        n = len(plain[i][0])
        assert sorted(lengths) == sorted(math.ceil(n / f - 1e-9) for f in (0.9, 1.0, 1.1))
    assert plain.durations == [1.0, 0.37]
    only_normal = SpeechDataset(plain.clips, bad=plain.bad, speed_perturb=(1.0, 1.001))
    assert only_normal.speed_perturb == () and only_normal.durations == plain.durations


def test_manifest_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError) as e:
        read_manifest(tmp_path / "nope.jsonl")
    assert fault(e.value)[:2] == ("manifest", str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no path"}\n')
    with pytest.raises(DataError) as e:
        read_manifest(bad)
    assert fault(e.value) == ("manifest", f"{bad}:1", ("audio_filepath and text",))
    with pytest.raises(ConfigError) as e:
        DATASETS.build("manifest")
    assert fault(e.value) == ("data.train", "", ("FILE",))


def _bad_files(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "garbage.wav").write_bytes(b"not audio at all")
    sf.write(folder / "empty.wav", np.zeros(0), 16_000)
    sf.write(folder / "stereo.wav", np.zeros((800, 2)), 16_000)
    nan = np.zeros(3200, dtype=np.float32)  # 0.2 s: long enough to be judged on its samples
    nan[10] = np.nan
    sf.write(folder / "nan.wav", nan, 16_000, subtype="FLOAT")
    return {p.stem: p for p in folder.iterdir()}


def test_bad_audio_is_detected_with_its_reason(tmp_path: Path) -> None:
    bad = _bad_files(tmp_path / "bad")
    good = tmp_path / "good.wav"
    _tone(good, 0.1)
    clips = [Clip(p, "x", 0.0) for p in bad.values()] + [Clip(good, "x", 0.0)]
    with pytest.raises(DataError) as e:
        check_clips(clips, "train")
    assert fault(e.value) == ("data.max_bad_fraction", "4/5", ("<= 0.01",))
    assert "garbage.wav (unreadable" in str(e.value) or "empty.wav (empty)" in str(e.value)
    reasons = {}
    for name, p in bad.items():  # one bad clip among 200 good ones is under 1%: skipped, not fatal
        kept, found = check_clips([Clip(p, "x", 0.0)] + [Clip(good, "x", 0.0)] * 200, "train")
        assert len(kept) == 200 and found.count == 1
        with pytest.raises(DataError) as e:
            check_clips([Clip(p, "x", 0.0), Clip(good, "x", 0.0)], "val")
        reasons[name] = str(e.value)
    assert "unreadable" in reasons["garbage"] and "(empty)" in reasons["empty"]
    assert "2 channels" in reasons["stereo"] and "NaN" in reasons["nan"]


def test_skipped_clips_are_logged_with_their_path(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = tmp_path / "good.wav"
    _tone(good, 0.1)
    bad = _bad_files(tmp_path / "bad")["stereo"]
    with caplog.at_level(logging.INFO, logger="audio.datasets"):
        check_clips([Clip(bad, "x", 0.0)] + [Clip(good, "x", 0.0)] * 150, "train")
    assert "1 of 151 clips in split 'train' are bad" in caplog.text and str(bad) in caplog.text


def test_speech_dataset_fails_loudly_if_a_file_vanishes(tmp_path: Path) -> None:
    p = tmp_path / "x.wav"
    _tone(p, 0.1)
    clips, bad = check_clips([Clip(p, "x", 0.0)], "train")
    ds = SpeechDataset(clips, bad=bad)
    p.unlink()
    with pytest.raises(DataError) as e:  # its only clip: nothing can take its place
        ds[0]
    assert fault(e.value) == ("data.max_bad_fraction", "1/1", ("<= 0.01",))


def _with_good(bad: Path, tmp_path: Path, n: int = 150) -> list[Clip]:
    good = tmp_path / "good.wav"
    _tone(good, 0.5)
    return [Clip(bad, "x", 0.0)] + [Clip(good, "x", 0.0)] * n


def test_truncated_and_too_short_wavs_are_found_from_their_headers(tmp_path: Path) -> None:
    cut = tmp_path / "cut.wav"
    _tone(cut, 1.0, subtype="PCM_16")
    cut.write_bytes(cut.read_bytes()[:20_000])  # the header still promises 16,000 frames
    short = tmp_path / "short.wav"
    _tone(short, 0.01)
    for bad, why in ((cut, "truncated"), (short, "shorter than")):
        kept, found = check_clips(_with_good(bad, tmp_path), "train")
        assert len(kept) == 150 and found.found[0][0] == str(bad) and why in found.found[0][1]
        with pytest.raises(DataError) as e:
            check_clips(_with_good(bad, tmp_path), "train", policy=BadSamplePolicy("error"))
        assert fault(e.value)[:2] == ("sample", str(bad))


def test_silent_and_undecodable_clips_are_found_when_read_and_replaced(tmp_path: Path, caplog) -> None:
    silent = tmp_path / "silent.wav"
    sf.write(silent, np.zeros(8000), 16_000)
    flac = tmp_path / "cut.flac"
    sf.write(flac, 0.1 * np.random.default_rng(0).standard_normal(16_000), 16_000)  # noise: no compression
    flac.write_bytes(flac.read_bytes()[:15_000])  # STREAMINFO promises 1 s; the frames stop early
    for bad in (silent, flac):
        clips, found = check_clips(_with_good(bad, tmp_path), "train")
        assert len(clips) == 151  # the headers look fine
        ds = SpeechDataset(clips, bad=found)
        wav, _ = ds[0]
        assert torch.equal(wav, ds[1][0]) and found.count == 1 and str(bad) in caplog.text
        clips, found = check_clips(_with_good(bad, tmp_path), "train", policy=BadSamplePolicy("error"))
        strict = SpeechDataset(clips, bad=found)
        with pytest.raises(DataError) as e:
            strict[0]
        assert fault(e.value)[:2] == ("sample", str(bad))


def _fast_clips_manifest(tmp_path: Path) -> Path:
    """Real WAVs: at 2x subsampling a 0.2 s clip has 11 output frames; 'a b c d e f' needs 11 labels, 'aaaaaa'
    11 (6 letters, 5 blanks between repeats), 'abcdefghijkl' 12: the last is too fast for the model."""
    texts = {
        "ok.wav": "a b c d e f",
        "repeats.wav": "aaaaaa",
        "fast.wav": "abcdefghijkl",
        "long.wav": "hello",
    }
    for name in texts:
        _tone(tmp_path / name, 1.0 if name == "long.wav" else 0.2)
    man = tmp_path / "m.jsonl"
    man.write_text("".join(json.dumps({"audio_filepath": n, "text": t}) + "\n" for n, t in texts.items()))
    return man


def test_clips_too_fast_for_the_model_are_skipped_named_and_counted(tmp_path: Path, caplog) -> None:
    from audio.asr import ASRTask
    from audio.ctc import frames_needed
    from core.data import bad_samples as badsamples

    man = _fast_clips_manifest(tmp_path)
    data = {"name": "manifest", "train": str(man), "val": str(man), "max_bad_fraction": 0.5}
    task = ASRTask(model={"name": "conformer_ctc_xs", "subsampling": 2}, data=data, speed_perturb=[])
    task.build_model()
    assert task.output_frames(3200) == 11  # 0.2 s: 21 feature frames, 11 after the stride-2 front end
    start = badsamples.mark()
    with caplog.at_level(logging.WARNING):
        train, val = task.build_datasets()
    assert [c.path.name for c in train.clips] == ["ok.wav", "repeats.wav", "long.wav"]
    assert [c.path.name for c in val.clips] == ["ok.wav", "repeats.wav", "long.wav"]
    assert train.bad.count == 1 and badsamples.count_since(start) == 2  # one per split
    assert str(tmp_path / "fast.wav") in caplog.text
    for i in range(len(train)):  # every kept clip has a finite CTC loss without zero_infinity
        wav, ids = train[i]
        frames = task.output_frames(len(wav))
        assert frames >= frames_needed(ids.tolist())
        log_probs = torch.randn(frames, 1, 29).log_softmax(-1)
        loss = torch.nn.functional.ctc_loss(log_probs, ids[None], [frames], [len(ids)], reduction="sum")
        assert torch.isfinite(loss)


def test_a_clip_too_fast_for_the_model_stops_the_run_under_on_bad_sample_error(tmp_path: Path) -> None:
    from audio.asr import ASRTask

    man = _fast_clips_manifest(tmp_path)
    data = {"name": "manifest", "train": str(man), "val": str(man), "on_bad_sample": "error"}
    task = ASRTask(model={"name": "conformer_ctc_xs", "subsampling": 2}, data=data, speed_perturb=[])
    task.build_model()
    with pytest.raises(DataError) as e:
        task.build_datasets()
    assert str(e.value).startswith(f"{tmp_path / 'fast.wav'}: too fast for the model")


def test_speed_perturbation_counts_the_fastest_factor(tmp_path: Path) -> None:
    from audio.asr import ASRTask

    man = _fast_clips_manifest(tmp_path)
    data = {"name": "manifest", "train": str(man), "val": str(man), "max_bad_fraction": 0.9}
    task = ASRTask(model={"name": "conformer_ctc_xs", "subsampling": 2}, data=data, speed_perturb=[1.0, 1.1])
    task.build_model()
    train, val = task.build_datasets()
    # at 1.1x a 0.2 s clip has 2909 samples: 19 feature frames, 10 output frames, too few for 11 labels
    assert [c.path.name for c in train.clips] == ["long.wav"]
    assert [c.path.name for c in val.clips] == ["ok.wav", "repeats.wav", "long.wav"]


def test_voices_without_a_held_out_engine_has_no_test_engine_split(
    monkeypatch, tmp_path: Path, caplog
) -> None:
    from audio.datasets import voices
    from audio.voices_corpus import espeak_installed

    if not espeak_installed():
        pytest.skip("eSpeak NG is not installed")
    monkeypatch.setenv("TORCHKILN_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="audio.datasets"), pytest.raises(DataError) as e:
        voices(engines=["espeak"], test_engine="none", eval_split="test_engine")
    assert fault(e.value) == ("data.eval_split", "test_engine", ("val",))
    # the one line that says which engines the corpus uses came first
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("voices corpus:")]
    assert len(lines) == 1 and "training engines espeak" in lines[0] and "test_engine: none" in lines[0]
