"""The embedded eSpeak NG corpus: a deterministic plan, byte-identical generation, held-out voices."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf

from audio import corpus, voices_corpus
from audio.espeak import EspeakLibrary
from core.errors import DataError
from tests.helpers import REPO, cli_env, fault

TINY = {"train": 6, "val": 3, "test": 3}


def test_plan_is_seeded_and_holds_out_voices_and_sequences() -> None:
    sizes = {"train": 2000, "val": 200, "test": 200}
    plan = corpus.plan_corpus(0, sizes)
    assert plan == corpus.plan_corpus(0, sizes) and plan != corpus.plan_corpus(1, sizes)
    assert len(corpus.VOCABULARY) >= 100 and len(plan) == 2400
    by = {s: [u for u in plan if u.split == s] for s in corpus.SPLITS}
    assert all(1 <= len(u.text.split()) <= 6 for u in plan)
    assert all(w in corpus.VOCABULARY for u in plan for w in u.text.split())
    variants = {s: {u.voice.split("+")[1] for u in by[s]} for s in corpus.SPLITS}
    accents = {u.voice.split("+")[0] for u in by["train"]}
    assert accents == set(corpus.ACCENTS)
    random_speakers = {v for v in variants["train"] if v.startswith("tk")}
    assert len(random_speakers) > 150 and len(variants["train"] - random_speakers) >= 40
    assert variants["val"] | variants["test"] <= set(corpus.VARIANTS)  # evaluation: bundled voices only
    assert (
        not variants["train"] & (variants["val"] | variants["test"])
        and not variants["val"] & variants["test"]
    )
    texts = {s: {u.text for u in by[s]} for s in corpus.SPLITS}
    assert not texts["train"] & (texts["val"] | texts["test"]) and not texts["val"] & texts["test"]


def test_generation_is_byte_identical_for_a_seed(tmp_path: Path) -> None:
    for name in ("a", "b"):
        corpus.generate_corpus(tmp_path / name, 7, TINY, jobs=2, progress=False)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len([f for f in files if f.suffix == ".wav"]) == 12
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    rows = [json.loads(x) for x in (tmp_path / "a" / "val.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows] == [u.text for u in corpus.plan_corpus(7, TINY) if u.split == "val"]
    for r in rows:
        info = sf.info(str(tmp_path / "a" / r["audio_filepath"]))
        assert info.samplerate == 16_000 and info.channels == 1 and info.subtype == "PCM_16"
        assert r["duration"] == pytest.approx(info.frames / 16_000, abs=1e-4) and r["duration"] > 0.1


def test_missing_espeak_is_a_one_line_data_error(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "espeakng_loader", None)  # makes the import fail
    with pytest.raises(DataError) as e:
        EspeakLibrary()
    assert fault(e.value) == ("espeak", "espeakng_loader", ("torchkiln[speech]", "espeak-ng on PATH"))
    monkeypatch.setenv("PATH", str(tmp_path))  # and no espeak-ng program either
    with pytest.raises(DataError) as e:
        corpus.generate_corpus(tmp_path / "out", 0, TINY, progress=False)
    assert fault(e.value) == ("espeak", "espeak-ng", ("torchkiln[speech]", "espeak-ng on PATH"))


#: Stands in for the espeak-ng program: logs its argv, answers --version, writes a 22.05 kHz tone per text.
FAKE_ESPEAK = """#!{python}
import json, math, struct, sys, wave
from pathlib import Path
argv = sys.argv[1:]
if argv == ["--version"]:
    print("eSpeak NG text-to-speech: 1.51  Data at: {data}")
    sys.exit(0)
with open("{log}", "a") as f:
    f.write(json.dumps(argv) + "\\n")
out = argv[argv.index("-w") + 1]
n = 2205 * len(argv[-1])
with wave.open(out, "wb") as w:
    w.setnchannels(1); w.setsampwidth(2); w.setframerate(22050)
    w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(i / 9))) for i in range(n)))
"""


def test_espeak_program_on_path_is_the_fallback(monkeypatch, tmp_path: Path) -> None:
    data = tmp_path / "system" / "espeak-ng-data"
    (data / "voices" / "!v").mkdir(parents=True)
    (data / "lang" / "gmw").mkdir(parents=True)
    (data / "phondata").write_bytes(b"")
    for v in corpus.VARIANTS:
        (data / "voices" / "!v" / v).write_text(f"name {v}\n")
    bin_dir, log = tmp_path / "bin", tmp_path / "argv.jsonl"
    bin_dir.mkdir()
    fake = bin_dir / "espeak-ng"
    fake.write_text(FAKE_ESPEAK.format(python=sys.executable, data=data, log=log))
    fake.chmod(0o755)
    monkeypatch.setitem(sys.modules, "espeakng_loader", None)
    monkeypatch.setenv("PATH", str(bin_dir))
    out = tmp_path / "corpus"
    corpus.generate_corpus(out, 7, TINY, jobs=2, progress=False)
    plan = {u.text: u for u in corpus.plan_corpus(7, TINY)}
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == sum(TINY.values())
    for argv in calls:
        utt = plan[argv[-1]]  # the text comes last, after "--"
        assert argv[-2] == "--" and argv[0] == f"--path={out}.tmp{os.getpid()}/raw"
        opts = dict(zip(argv[1:-2:2], argv[2:-2:2], strict=True))
        assert opts["-v"] == utt.voice and opts["-s"] == str(utt.rate) and opts["-p"] == str(utt.pitch)
    # the random speakers' variant files were added beside the program's own data
    assert any("+tk" in argv[2] for argv in calls)
    rows = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    assert len(rows) == TINY["train"]
    for r in rows:
        info = sf.info(str(out / r["audio_filepath"]))
        assert info.samplerate == 16_000 and info.channels == 1
        # 0.1 s per character at 22.05 kHz, resampled: the duration survives the WAV -> PCM -> 16 kHz path
        assert r["duration"] == pytest.approx(0.1 * len(r["text"]), abs=1e-3)


def test_library_never_imports_espeak() -> None:
    code = "import audio, sys; assert 'espeakng_loader' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_random_speakers_are_seeded_variant_files() -> None:
    text = corpus.random_variant(0, 5)
    assert text == corpus.random_variant(0, 5) and text != corpus.random_variant(1, 5)
    lines = dict(
        line.split(" ", 1) for line in text.splitlines() if line.startswith(("name", "pitch", "gender"))
    )
    assert lines["name"] == "tk005" and lines["gender"] in ("male", "female")
    low, high = map(int, lines["pitch"].split())
    assert 65 <= low < high


# ---- the multi-engine corpus (data=voices) ----

#: every engine's voices as audio/engines.py lists them (a plan needs no engine installed)
ALL_VOICES = (
    *(("espeak", v, f"espeak-{v}") for v in corpus.VARIANTS),
    ("flite", "slt", "slt"),
    ("flite", "rms", "rms"),
    ("flite", "awb", "awb"),
    ("flite", "kal16", "kal"),
    ("festival", "kal_diphone", "kal"),
    ("festival", "ked_diphone", "ked"),
    ("festival", "cmu_us_slt_arctic_hts", "slt"),
    ("piper", "en_US-joe-medium", "joe"),
)


def _settings(text: str = "kjv", seed: int = 0, **sizes: int) -> voices_corpus.VoicesSettings:
    sizes = {"train": 3000, "val": 300, "test_engine": 300, **sizes}
    engines = ("espeak", "flite", "festival")
    speakers = voices_corpus.VAL_SPEAKERS
    return voices_corpus.VoicesSettings(seed, sizes, engines, "piper", text, speakers, ALL_VOICES)


def test_voices_splits_are_disjoint_by_speaker_and_by_engine() -> None:
    plan = voices_corpus.plan_voices(_settings())
    assert plan == voices_corpus.plan_voices(_settings())
    assert plan[:100] != voices_corpus.plan_voices(_settings(seed=1, train=100, val=1, test_engine=1))[:100]
    by = {s: [u for u in plan if u.split == s] for s in voices_corpus.VOICE_SPLITS}
    assert {s: len(u) for s, u in by.items()} == {"train": 3000, "val": 300, "test_engine": 300}
    engines = {s: {u.engine for u in by[s]} for s in voices_corpus.VOICE_SPLITS}
    assert engines["train"] == engines["val"] == {"espeak", "flite", "festival"}
    assert engines["test_engine"] == {"piper"}
    speakers = {s: {u.speaker for u in by[s]} for s in voices_corpus.VOICE_SPLITS}
    # a person is held out in every engine: flite's and Festival's slt and kal voices are one person each
    assert {"slt", "kal", "rms"} <= speakers["train"] and {"awb", "ked"} <= speakers["val"]
    assert not speakers["train"] & speakers["val"] and speakers["test_engine"] == {"joe"}
    assert len({s for s in speakers["val"] if s.startswith("espeak-")}) == corpus.HELD_OUT_VARIANTS
    assert all(u.engine != "espeak" or "+" in u.voice for u in plan)
    assert all(0.85 <= u.stretch <= 1.2 for u in plan if u.engine != "espeak")
    # Piper's duration factors come in steps of 0.05 (one process per factor)
    assert all(round(u.stretch * 20, 6).is_integer() for u in by["test_engine"])
    texts = {s: {u.text for u in by[s]} for s in voices_corpus.VOICE_SPLITS}
    assert (
        not texts["train"] & (texts["val"] | texts["test_engine"]) and not texts["val"] & texts["test_engine"]
    )
    # an open vocabulary: thousands of distinct words, spelled in the CTC alphabet
    words = {w for u in by["train"] for w in u.text.split()}
    assert len(words) > 2500 and all(re.fullmatch(r"[a-z' ]+", u.text) for u in plan)
    assert all(1 <= len(u.text.split()) <= voices_corpus.KJV_WORDS[1] for u in plan)


def test_voices_keep_the_115_word_preset_by_name() -> None:
    plan = voices_corpus.plan_voices(_settings("words115", train=200, val=50, test_engine=50))
    assert all(w in corpus.VOCABULARY for u in plan for w in u.text.split())


def test_holding_out_every_voice_of_an_engine_is_one_line() -> None:
    settings = voices_corpus.VoicesSettings(
        0,
        {"train": 4, "val": 2, "test_engine": 0},
        ("flite",),
        "",
        "kjv",
        ("slt", "rms", "awb", "kal"),
        ALL_VOICES[-8:-4],
    )
    with pytest.raises(DataError) as e:
        voices_corpus.plan_voices(settings)
    key, _, valid = fault(e.value)
    assert key == "data.val_speakers" and set(valid) == {"slt", "rms", "awb", "kal"}


def test_the_voices_corpus_is_cached_by_its_settings(monkeypatch, tmp_path: Path) -> None:
    if not voices_corpus.espeak_installed():
        pytest.skip("eSpeak NG is not installed")
    monkeypatch.setenv("TORCHKILN_CACHE", str(tmp_path))
    sizes = {"train": 4, "val": 2, "test_engine": 2}
    settings, line = voices_corpus.resolve_voices(3, sizes, engines=["espeak"], test_engine="none")
    assert line.startswith("voices corpus: training engines espeak (69 voices); test_engine: none")
    calls = []

    def generate(out: Path, args: list[str], *, progress: bool) -> None:
        # in this process (the subprocess path is ensure_corpus's, tested with every ASR run)
        calls.append(out)
        assert args[0] == "--voices"
        voices_corpus.generate_voices(out, voices_corpus.VoicesSettings.from_json(args[1]), progress=progress)

    monkeypatch.setattr(corpus, "_generate_in_child", generate)
    root = voices_corpus.ensure_voices(settings, progress=False)
    rows = {
        s: [json.loads(x) for x in (root / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "val")
    }
    assert [len(rows["train"]), len(rows["val"])] == [4, 2] and not (root / "test_engine.jsonl").exists()
    assert {r["engine"] for r in rows["train"]} == {"espeak"}
    assert not {r["speaker"] for r in rows["train"]} & {r["speaker"] for r in rows["val"]}
    assert voices_corpus.VoicesSettings.from_json((root / "settings.json").read_text()) == settings
    # the second call finds it: no generator starts
    assert voices_corpus.ensure_voices(settings, progress=False) == root and calls == [root]
    other, _ = voices_corpus.resolve_voices(3, sizes, engines=["espeak"], test_engine="none", text="words115")
    assert voices_corpus.voices_dir(other) != root


def test_processes_starting_together_generate_the_voices_corpus_once(monkeypatch, tmp_path: Path) -> None:
    import threading
    import time

    monkeypatch.setenv("TORCHKILN_CACHE", str(tmp_path))
    settings = _settings(train=4, val=2, test_engine=2)
    calls = []

    def generate(out: Path, args: list[str], *, progress: bool) -> None:
        calls.append(out)
        time.sleep(0.3)  # long enough for the other starter to find the corpus missing
        out.mkdir(parents=True)
        for split in voices_corpus.VOICE_SPLITS:
            (out / f"{split}.jsonl").write_text("")

    monkeypatch.setattr(corpus, "_generate_in_child", generate)
    # each thread opens the lock file itself, so flock excludes them as it does two processes
    found = []
    starters = [
        threading.Thread(target=lambda: found.append(voices_corpus.ensure_voices(settings))) for _ in range(2)
    ]
    for t in starters:
        t.start()
    for t in starters:
        t.join()
    assert calls == [voices_corpus.voices_dir(settings)] and found == calls * 2
