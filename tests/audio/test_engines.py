"""The recorded-voice engines (audio/engines.py): each speaks a clip of every voice it has, the same bytes
twice; a missing one is a one-line error naming it. Each engine's test skips where it is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from audio import corpus, engines, voices_corpus
from core.errors import ConfigError, DataError
from tests.helpers import REPO, cli_env, fault


def _speak(
    engine: str, voices: list[engines.Voice], folder: Path
) -> dict[tuple[str, float], tuple[bytes, int]]:
    """(voice, duration factor) -> (PCM, sample rate) of a clip per voice at factors 0.85 and 1.2, through
    `engine`'s driver as the generator runs it."""
    driver = engines.DRIVERS[engine]()
    utts = [
        corpus.Utterance(
            "train", 2 * i + k, "the light in the kitchen", v.name, 0, 0, 0, 0, engine, v.speaker, f
        )
        for i, v in enumerate(voices)
        for k, f in enumerate((0.85, 1.2))
    ]
    folder.mkdir()
    out = {}
    # each voice in its own batches, so each is the first of a batch (a Festival script once assumed an HTS
    # voice had been selected before it)
    for batch in [b for v in voices for b in driver.batches([u for u in utts if u.voice == v.name])]:
        _, status = os.waitpid(driver.start(batch, folder), 0)
        assert os.waitstatus_to_exitcode(status) == 0
        for u, (raw, rate) in zip(batch, driver.finish(batch, folder), strict=True):
            assert rate in (16_000, 22_050, 32_000)
            out[u.voice, u.stretch] = raw.read_bytes(), rate
    return out


# Piper's model loads in ~1 s a process (4 here, on a loaded host 8 s in all): a slow test
@pytest.mark.parametrize("engine", ["festival", "flite", pytest.param("piper", marks=pytest.mark.slow)])
def test_each_engine_speaks_every_voice_the_same_twice_at_its_speed(engine: str, tmp_path: Path) -> None:
    voices = engines.find_voices(engine)
    if not voices:
        pytest.skip(f"{engine} is not installed: {engines.ENGINES[engine].install}")
    first = _speak(engine, voices, tmp_path / "a")
    assert first == _speak(engine, voices, tmp_path / "b") and len(first) == 2 * len(voices)
    for v in voices:
        (fast, rate), (slow, _) = first[v.name, 0.85], first[v.name, 1.2]
        # 4 words: between 0.5 s and 4 s of int16 samples, not silence
        assert 0.5 * rate * 2 < len(fast) < 4 * rate * 2 and any(fast)
        # the duration factor reaches every voice (Festival's HTS voice takes it as a rate): 1.2 / 0.85 = 1.41
        # less the pauses that do not stretch
        assert 1.2 < len(slow) / len(fast) < 1.6, v


def test_a_missing_engine_is_one_line_naming_it(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no flite, no festival
    with pytest.raises(DataError) as e:
        voices_corpus.resolve_voices(0, {"train": 4, "val": 2, "test_engine": 2}, engines=["flite"])
    key, value, valid = fault(e.value)
    assert (key, value) == ("data.engines", "flite") and "flite" not in valid
    assert "apt-get install flite" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DataError) as e:
        voices_corpus.resolve_voices(0, {"train": 4, "val": 2, "test_engine": 2}, test_engine="festival")
    assert fault(e.value)[:2] == ("data.test_engine", "festival")
    with pytest.raises(ConfigError) as e:
        sizes = {"train": 4, "val": 2, "test_engine": 2}
        voices_corpus.resolve_voices(0, sizes, engines=["espeak", "mbrola"])
    assert fault(e.value) == ("data.engines", "mbrola", voices_corpus.ENGINE_NAMES)


def test_an_engine_is_trained_on_or_held_out_not_both() -> None:
    if not voices_corpus.espeak_installed():
        pytest.skip("eSpeak NG is not installed")
    with pytest.raises(ConfigError) as e:
        voices_corpus.resolve_voices(
            0, {"train": 4, "val": 2, "test_engine": 2}, engines=["espeak"], test_engine="espeak"
        )
    assert fault(e.value)[:2] == ("data.test_engine", "espeak")


#: loads audio/corpus.py by path, as the generator's subprocess does (no torch, no `audio` package), and the
#: voices corpus's design through it
BY_PATH = """import importlib.util, sys
spec = importlib.util.spec_from_file_location("corpus_by_path", "audio/corpus.py")
corpus = sys.modules[spec.name] = importlib.util.module_from_spec(spec); spec.loader.exec_module(corpus)
voices_corpus = corpus.sibling("voices_corpus")
"""


def test_finding_the_engines_imports_none_of_them() -> None:
    code = BY_PATH + (
        "voices_corpus.resolve_voices(0, {'train': 4, 'val': 2, 'test_engine': 2})\n"
        "assert not {'piper', 'espeakng_loader', 'onnxruntime', 'torch'} & set(sys.modules)"
    )
    env = cli_env({"PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])})
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_voices_corpus_is_generated_by_the_real_subprocess(monkeypatch, tmp_path: Path) -> None:
    # audio/corpus.py run by path in a fresh interpreter loads the voices design (audio/voices_corpus.py) by
    # path too: a corpus of two engines' clips, every manifest row's WAV on disk, the settings beside them
    if not (engines.find_voices("flite") and engines.find_voices("festival")):
        pytest.skip("flite and Festival are not both installed")
    monkeypatch.setenv("TORCHKILN_CACHE", str(tmp_path))
    sizes = {"train": 4, "val": 2, "test_engine": 2}
    settings, _ = voices_corpus.resolve_voices(3, sizes, engines=["flite"], test_engine="festival")
    root = voices_corpus.ensure_voices(settings, progress=False)
    for split, n, engine in (("train", 4, "flite"), ("val", 2, "flite"), ("test_engine", 2, "festival")):
        rows = [json.loads(x) for x in (root / f"{split}.jsonl").read_text().splitlines()]
        assert len(rows) == n and {r["engine"] for r in rows} == {engine}
        assert all((root / r["audio_filepath"]).stat().st_size > 1000 for r in rows)
    assert voices_corpus.VoicesSettings.from_json((root / "settings.json").read_text()) == settings
