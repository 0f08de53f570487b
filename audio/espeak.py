"""eSpeak NG drivers behind one interface, for the embedded corpus generator (`audio/corpus.py`).

`EspeakLibrary` drives the libespeak-ng that the `espeakng-loader` wheel bundles (ctypes, one forked child
per clip); `EspeakProgram` runs an `espeak-ng` program from PATH. Both: `check_variants(names)`,
`synthesize_to(utterance, raw_path)` starting a child and returning its pid, and `finish(raw_path)` once it
exited 0, returning the sample rate of the int16 PCM left at raw_path. eSpeak NG is GPL-3: this module loads
it only when a driver is made, in the generator's subprocess, never in the training process. It imports
nothing of torch or of the `audio` package, since the generator loads it by path.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from audio.engines import wav_to_raw
from core.errors import DataError

#: makes the data folder a driver uses from the one it found (None: that folder as it is)
PrepareData = Callable[[Path], Path]

# espeak_lib.h constants
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_DONT_EXIT = 0x8000
_CHARS_UTF8 = 1
_POS_CHARACTER = 1
_RATE, _PITCH, _RANGE = 1, 3, 4


#: what the corpus needs, as the error's valid field: one of these installed
ESPEAK_SOURCES = ("torchkiln[speech]", "espeak-ng on PATH")
NO_ESPEAK = (
    "the embedded speech corpus needs eSpeak NG: pip install 'torchkiln[speech]' (espeakng-loader) or put "
    "an espeak-ng program on PATH, or point data= at LibriSpeech or a manifest"
)


def check_variants(data_path: Path, names: list[str]) -> None:
    folder = data_path / "voices" / "!v"
    missing = [v for v in names if not (folder / v).is_file()]
    if missing:
        raise DataError(f"eSpeak NG voice variants missing from {folder}: {', '.join(missing)}")


class EspeakLibrary:
    """The bundled libespeak-ng, initialised once; each utterance is synthesised in a forked child.

    The library keeps global state (threads crash it, and repeated calls in one process are not
    byte-identical), so a child forked from the freshly initialised parent gives identical bytes every run.
    """

    def __init__(self, prepare_data: PrepareData | None = None) -> None:
        """Load the library from espeakng-loader; initialise it on its data, or on what `prepare_data`
        makes of that folder (the corpus adds its random speakers there)."""
        try:
            import espeakng_loader
        except ImportError:
            raise DataError(NO_ESPEAK, key="espeak", value="espeakng_loader", valid=ESPEAK_SOURCES) from None
        self.data_path = espeakng_loader.get_data_path()
        if prepare_data is not None:
            self.data_path = str(prepare_data(Path(self.data_path)))
        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self.lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        self.lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int]
        self.lib.espeak_Synth.argtypes += [ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self.lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        # Without DONT_EXIT a bad data path calls exit() inside the library and kills Python.
        self.rate = self.lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, 0, self.data_path.encode(), _INITIALIZE_DONT_EXIT
        )
        if self.rate <= 0:
            raise DataError(
                f"eSpeak NG failed to initialise from {self.data_path}; reinstall espeakng-loader"
            )
        self._chunks: list[bytes] = []
        callback_type = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
        )
        self._callback = callback_type(self._collect)  # kept alive: the library holds only a raw pointer
        self.lib.espeak_SetSynthCallback(self._callback)

    def _collect(self, wav: ctypes.POINTER(ctypes.c_short), n: int, events: ctypes.c_void_p) -> int:
        if n > 0:
            self._chunks.append(ctypes.string_at(wav, n * 2))
        return 0

    def check_variants(self, names: list[str]) -> None:
        """Fail on variant names the data lacks: the library silently ignores an unknown `+variant`."""
        check_variants(Path(self.data_path), names)

    def synthesize_to(self, utt: Any, raw_path: Path) -> int:
        """Fork a child that speaks `utt` into `raw_path` as int16 PCM at `self.rate`; return its pid."""
        pid = os.fork()
        if pid:
            return pid
        try:  # the child: never return into the parent's code
            self.lib.espeak_ng_SetRandSeed(utt.seed)  # it seeds from the clock otherwise
            if self.lib.espeak_SetVoiceByName(utt.voice.encode()) != 0:
                os._exit(3)
            # Setting a voice resets these, so they come after it.
            self.lib.espeak_SetParameter(_RATE, utt.rate, 0)
            self.lib.espeak_SetParameter(_PITCH, utt.pitch, 0)
            self.lib.espeak_SetParameter(_RANGE, utt.pitch_range, 0)
            text = utt.text.encode()
            if self.lib.espeak_Synth(text, len(text) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None) != 0:
                os._exit(4)
            raw_path.write_bytes(b"".join(self._chunks))
            os._exit(0)
        except BaseException:
            os._exit(5)

    def finish(self, raw_path: Path) -> int:
        """The sample rate of the PCM a child wrote to `raw_path` (the library's, fixed at initialisation)."""
        return self.rate


class EspeakProgram:
    """Fallback without espeakng-loader: the `espeak-ng` program on PATH, one process per clip.

    Same plan, voices, variants, speeds and pitches as the library path, but the program has no option for
    the pitch range nor for the random seed. Checked with Debian 12's espeak-ng 1.51: 40 of 40 clips were
    byte-identical run to run, but they are not the library's clips (median 1.35x longer), so a corpus made
    this way gets its own numbers; the library path (the `speech` extra) is the reference.
    """

    def __init__(self, program: str, prepare_data: PrepareData | None = None) -> None:
        """Find the program's data folder (`--version` names it); use what `prepare_data` makes of it."""
        try:
            version = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            raise DataError(f"{program} --version failed ({type(e).__name__}): {NO_ESPEAK}") from None
        found = re.search(r"Data at:\s*(\S+)", version.stdout)
        if version.returncode != 0 or found is None or not Path(found.group(1)).is_dir():
            raise DataError(f"{program} --version names no data folder: {NO_ESPEAK}")
        self.program = program
        self.data_path = found.group(1)
        if prepare_data is not None:
            self.data_path = str(prepare_data(Path(self.data_path)))

    def check_variants(self, names: list[str]) -> None:
        """Fail on variant names the data lacks: the program silently ignores an unknown `+variant`."""
        check_variants(Path(self.data_path), names)

    def argv(self, utt: Any, wav_path: Path) -> list[str]:
        """The command that speaks `utt` into `wav_path`."""
        # --path names the folder that holds espeak-ng-data; "--" keeps a text from being read as options
        return [
            self.program,
            f"--path={Path(self.data_path).parent}",
            *("-v", utt.voice, "-s", str(utt.rate), "-p", str(utt.pitch), "-w", str(wav_path)),
            *("--", utt.text),
        ]

    def synthesize_to(self, utt: Any, raw_path: Path) -> int:
        """Start the program on `utt` (its WAV goes beside `raw_path`); return its pid."""
        argv = self.argv(utt, raw_path.with_suffix(".wav"))
        return os.posix_spawn(self.program, argv, os.environ)

    def finish(self, raw_path: Path) -> int:
        """Turn the program's WAV into `raw_path` (int16 PCM); return its sample rate."""
        raw, rate = wav_to_raw(raw_path.with_suffix(".wav"), self.program)
        if raw != raw_path:
            raw.replace(raw_path)
        return rate


#: either driver: the interface the module docstring describes
Synthesizer = EspeakLibrary | EspeakProgram


def synthesizer(prepare_data: PrepareData | None = None) -> Synthesizer:
    """The bundled library when espeakng-loader is installed, else an `espeak-ng` program on PATH."""
    try:
        import espeakng_loader  # noqa: F401  (the loader only; the GPL library loads in EspeakLibrary)
    except ImportError:
        pass
    else:
        return EspeakLibrary(prepare_data)
    program = shutil.which("espeak-ng")
    if program is None:
        raise DataError(NO_ESPEAK, key="espeak", value="espeak-ng", valid=ESPEAK_SOURCES)
    return EspeakProgram(program, prepare_data)
