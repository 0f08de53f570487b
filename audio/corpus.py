"""The embedded speech corpus: word sequences spoken by eSpeak NG voices, generated once and cached.

eSpeak NG is GPL-3 and ships in the optional `speech` extra (`espeakng-loader`), so this module never imports
it at module level: `ensure_corpus` runs this file in a subprocess, which keeps the GPL library
out of the training process and forks synthesis children from a small process. Without the extra, an
`espeak-ng` program on PATH is the fallback (one process per clip; other clips than the library's, see
`_EspeakProgram`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import re
import shutil
import subprocess
import sys
import wave
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from core.errors import DataError
from core.paths import cache_root

#: Bumped whenever the plan or the synthesis changes, so stale caches are never reused.
CORPUS_VERSION = 2
SAMPLE_RATE = 16_000
SPLITS = ("train", "val", "test")

_DIGITS = "zero one two three four five six seven eight nine ten"
_COMMANDS = (
    "yes no up down left right on off stop go start open close play pause next back forward turn move show "
    "find call send set wait run jump follow learn"
)
_COMMON = (
    "the a to and is it of in for what where when who how this that my your please now then here there "
    "light music door window volume time day night morning today tomorrow red green blue white black big "
    "small fast slow cold hot new old good bad first last all more less house car dog cat bird tree water "
    "fire book phone room kitchen table chair bed visual happy sheila marvin wow"
)
#: Digits, commands and common words; every transcript is a sequence of these, as spoken.
VOCABULARY: tuple[str, ...] = tuple(dict.fromkeys(f"{_DIGITS} {_COMMANDS} {_COMMON}".split()))

#: English accents bundled with the wheel (`en-gb` is not a voice name there; `en` is British English).
ACCENTS = (
    "en",
    "en-US",
    "en-029",
    "en-GB-scotland",
    "en-GB-x-gbclan",
    "en-GB-x-gbcwmd",
    "en-GB-x-rp",
    "en-US-nyc",
)
#: Voice variants (files in espeak-ng-data/voices/!v); whispering, robotic and distorted ones are left out.
_VARIANTS = (
    "m1 m2 m3 m4 m5 m6 m7 m8 f1 f2 f3 f4 f5 klatt klatt2 klatt3 klatt4 Alex Alicia Andrea Andy Annie Denis "
    "Gene Hugo Jacky Lee Marco Mario Michael Mike Reed Storm adam anika announcer antonio aunty belinda "
    "benjamin boris caleb david ed edward grandma grandpa gustave ian iven john kaukovalta linda max michel "
    "miguel norbert pablo paul pedro quincy rob robert sandro shelby steph travis victor zac"
)
VARIANTS: tuple[str, ...] = tuple(_VARIANTS.split(" "))
#: Variants held out per evaluation split: their voices never speak in training.
HELD_OUT_VARIANTS = 8
#: Random speakers (generated variant files) that speak this fraction of the training utterances: 53 bundled
#: training variants alone let the model memorise voices (train loss 0.09 vs val 0.69 on held-out ones).
RANDOM_SPEAKERS = 200
RANDOM_SPEAKER_FRACTION = 0.5

# espeak_lib.h constants
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_DONT_EXIT = 0x8000
_CHARS_UTF8 = 1
_POS_CHARACTER = 1
_RATE, _PITCH, _RANGE = 1, 3, 4


@dataclass(frozen=True)
class Utterance:
    """One planned clip: what is said, by which voice, how, and where it is written."""

    split: str
    index: int
    text: str
    voice: str
    rate: int
    pitch: int
    pitch_range: int
    seed: int

    @property
    def relpath(self) -> str:
        """Path of the clip relative to the corpus folder."""
        return f"wav/{self.split}/{self.index:06d}.wav"


def corpus_dir(seed: int, sizes: dict[str, int]) -> Path:
    """Cache folder of the corpus for `seed` and split `sizes`."""
    tag = "-".join(f"{s}{sizes[s]}" for s in SPLITS)
    return cache_root() / "data" / f"espeak_words-v{CORPUS_VERSION}-seed{seed}-{tag}"


def plan_corpus(seed: int, sizes: dict[str, int]) -> list[Utterance]:
    """Every utterance of the corpus, a pure function of (seed, sizes).

    Validation and test voices use bundled variants never heard in training, and their word sequences never
    occur in training (nor in each other), so the held-out WER measures generalisation rather than memory.
    Half the training utterances come from random speakers (`random_variant`), the rest from the other
    bundled variants.
    """
    rng = random.Random(seed)
    variants = sorted(VARIANTS)
    rng.shuffle(variants)
    pools = {
        "val": variants[:HELD_OUT_VARIANTS],
        "test": variants[HELD_OUT_VARIANTS : 2 * HELD_OUT_VARIANTS],
        "train": variants[2 * HELD_OUT_VARIANTS :],
    }
    seen: set[str] = set()
    plan: list[Utterance] = []
    for split in SPLITS:
        split_seen: set[str] = set()
        for index in range(sizes[split]):
            for _ in range(1000):
                text = " ".join(rng.choices(VOCABULARY, k=rng.randint(1, 6)))
                if split == "train" or text not in seen:
                    break
            else:
                raise DataError(f"cannot draw {sizes[split]} unseen word sequences for split '{split}'")
            split_seen.add(text)
            if split == "train" and rng.random() < RANDOM_SPEAKER_FRACTION:
                variant = f"tk{rng.randrange(RANDOM_SPEAKERS):03d}"
            else:
                variant = rng.choice(pools[split])
            plan.append(
                Utterance(
                    split=split,
                    index=index,
                    text=text,
                    voice=f"{rng.choice(ACCENTS)}+{variant}",
                    rate=rng.randint(130, 200),
                    pitch=rng.randint(30, 70),
                    pitch_range=rng.randint(30, 80),
                    seed=zlib.crc32(f"{seed}/{split}/{index}".encode()),
                )
            )
        seen |= split_seen
    return plan


def random_variant(seed: int, index: int) -> str:
    """Text of an eSpeak NG variant file for random speaker `index`: pitch and formant scales per speaker."""
    rng = random.Random(f"{seed}/speaker/{index}")
    female = rng.random() < 0.5
    scale = rng.uniform(1.05, 1.25) if female else rng.uniform(0.85, 1.05)
    base = rng.randint(140, 200) if female else rng.randint(65, 110)
    lines = [
        "language variant",
        f"name tk{index:03d}",
        f"gender {'female' if female else 'male'}",
        f"pitch {base} {base + rng.randint(20, 90)}",
        f"flutter {rng.randint(0, 20)}",
        f"roughness {rng.randint(0, 3)}",
    ]
    for k in range(9):  # frequency %, height %, width % of each formant
        freq = round(100 * scale * rng.uniform(0.93, 1.07)) if 1 <= k <= 5 else 100
        lines.append(f"formant {k} {freq} {rng.randint(80, 120)} {rng.randint(80, 140)}")
    return "\n".join(lines) + "\n"


def _overlay_data(bundled: Path, dst: Path, seed: int) -> Path:
    """A data folder that links the bundled one and adds the random speakers' variant files.

    Only the English language files are linked: the library lists every language and variant at start-up and
    stops at 349 voices, which the bundled ~250 languages plus the random speakers would exceed.
    """
    dst.mkdir(parents=True)
    for entry in bundled.iterdir():
        if entry.name not in ("voices", "lang"):
            (dst / entry.name).symlink_to(entry)
    (dst / "lang" / "gmw").mkdir(parents=True)
    for f in (bundled / "lang" / "gmw").glob("en*"):
        (dst / "lang" / "gmw" / f.name).symlink_to(f)
    variants = dst / "voices" / "!v"
    variants.mkdir(parents=True)
    for f in (bundled / "voices" / "!v").iterdir():
        (variants / f.name).symlink_to(f)
    for i in range(RANDOM_SPEAKERS):
        (variants / f"tk{i:03d}").write_text(random_variant(seed, i))
    return dst


_NO_ESPEAK = (
    "the embedded speech corpus needs eSpeak NG: pip install 'torchkiln[speech]' (espeakng-loader) or put "
    "an espeak-ng program on PATH, or point data= at LibriSpeech or a manifest"
)


def _check_variants(data_path: Path, names: list[str]) -> None:
    folder = data_path / "voices" / "!v"
    missing = [v for v in names if not (folder / v).is_file()]
    if missing:
        raise DataError(f"eSpeak NG voice variants missing from {folder}: {', '.join(missing)}")


class _Espeak:
    """The bundled libespeak-ng, initialised once; each utterance is synthesised in a forked child.

    The library keeps global state (threads crash it, and repeated calls in one process are not
    byte-identical), so a child forked from the freshly initialised parent gives identical bytes every run.
    """

    def __init__(self, overlay: Path | None = None, seed: int = 0) -> None:
        """Load the library from espeakng-loader; initialise it on its data (or an overlay at `overlay`)."""
        try:
            import espeakng_loader
        except ImportError:
            raise DataError(_NO_ESPEAK) from None
        self.data_path = espeakng_loader.get_data_path()
        if overlay is not None:
            self.data_path = str(_overlay_data(Path(self.data_path), overlay, seed))
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
        _check_variants(Path(self.data_path), names)

    def synthesize_to(self, utt: Utterance, raw_path: Path) -> int:
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


class _EspeakProgram:
    """Fallback without espeakng-loader: the `espeak-ng` program on PATH, one process per clip.

    Same plan, voices, variants, speeds and pitches as the library path, but the program has no option for
    the pitch range nor for the random seed. Checked with Debian 12's espeak-ng 1.51: 40 of 40 clips were
    byte-identical run to run, but they are not the library's clips (median 1.35x longer), so a corpus made
    this way gets its own numbers; the library path (the `speech` extra) is the reference.
    """

    def __init__(self, program: str, overlay: Path | None = None, seed: int = 0) -> None:
        """Find the program's data folder (`--version` names it); add the random speakers in an overlay."""
        try:
            version = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            raise DataError(f"{program} --version failed ({type(e).__name__}): {_NO_ESPEAK}") from None
        found = re.search(r"Data at:\s*(\S+)", version.stdout)
        if version.returncode != 0 or found is None or not Path(found.group(1)).is_dir():
            raise DataError(f"{program} --version names no data folder: {_NO_ESPEAK}")
        self.program = program
        self.data_path = found.group(1)
        if overlay is not None:
            self.data_path = str(_overlay_data(Path(self.data_path), overlay, seed))

    def check_variants(self, names: list[str]) -> None:
        """Fail on variant names the data lacks: the program silently ignores an unknown `+variant`."""
        _check_variants(Path(self.data_path), names)

    def argv(self, utt: Utterance, wav_path: Path) -> list[str]:
        """The command that speaks `utt` into `wav_path`."""
        # --path names the folder that holds espeak-ng-data; "--" keeps a text from being read as options
        return [
            self.program,
            f"--path={Path(self.data_path).parent}",
            *("-v", utt.voice, "-s", str(utt.rate), "-p", str(utt.pitch), "-w", str(wav_path)),
            *("--", utt.text),
        ]

    def synthesize_to(self, utt: Utterance, raw_path: Path) -> int:
        """Start the program on `utt` (its WAV goes beside `raw_path`); return its pid."""
        argv = self.argv(utt, raw_path.with_suffix(".wav"))
        return os.posix_spawn(self.program, argv, os.environ)

    def finish(self, raw_path: Path) -> int:
        """Turn the program's WAV into `raw_path` (int16 PCM); return its sample rate."""
        wav_path = raw_path.with_suffix(".wav")
        try:
            with wave.open(str(wav_path), "rb") as w:
                if w.getsampwidth() != 2 or w.getnchannels() != 1:
                    raise DataError(f"{self.program} wrote {wav_path} in an unexpected format")
                rate, pcm = w.getframerate(), w.readframes(w.getnframes())
        except (OSError, EOFError, wave.Error) as e:
            raise DataError(f"{self.program} wrote no readable WAV at {wav_path} ({e})") from None
        raw_path.write_bytes(pcm)
        wav_path.unlink()
        return rate


#: what `_synthesize_all` needs of a synthesizer: `check_variants(names)`, `synthesize_to(utt, raw_path)` that
#: starts a child process and returns its pid, and `finish(raw_path)` once that child exited 0, which leaves
#: int16 PCM at raw_path and returns its sample rate
Synthesizer = _Espeak | _EspeakProgram


def _synthesizer(overlay: Path, seed: int) -> Synthesizer:
    """The bundled library when espeakng-loader is installed, else an `espeak-ng` program on PATH."""
    try:
        import espeakng_loader  # noqa: F401  (the loader only; the GPL library loads in _Espeak)
    except ImportError:
        pass
    else:
        return _Espeak(overlay, seed)
    program = shutil.which("espeak-ng")
    if program is None:
        raise DataError(_NO_ESPEAK)
    return _EspeakProgram(program, overlay, seed)


def _synthesize_all(
    plan: list[Utterance], out: Path, jobs: int, seed: int
) -> Iterator[tuple[Utterance, Path, int]]:
    """Yield (utterance, raw PCM path, sample rate) as forked children finish, `jobs` at a time."""
    espeak = _synthesizer(out / "espeak-ng-data", seed)
    espeak.check_variants(sorted({u.voice.split("+")[1] for u in plan}))
    running: dict[int, tuple[Utterance, Path]] = {}
    todo = iter(plan)
    while True:
        while len(running) < jobs and (utt := next(todo, None)) is not None:
            raw = out / f"{utt.split}-{utt.index:06d}.raw"
            running[espeak.synthesize_to(utt, raw)] = (utt, raw)
        if not running:
            return
        pid, status = os.wait()
        utt, raw = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            raise DataError(f"eSpeak NG failed on '{utt.text}' with voice {utt.voice} (exit code {code})")
        rate = espeak.finish(raw)
        if not raw.is_file():
            raise DataError(f"eSpeak NG wrote no audio for '{utt.text}' with voice {utt.voice}")
        yield utt, raw, rate


def generate_corpus(
    out: Path, seed: int, sizes: dict[str, int], *, jobs: int = 2, progress: bool = True
) -> None:
    """Synthesise the corpus into `out` (16 kHz PCM-16 WAV + one JSONL manifest per split), atomically."""
    from tqdm import tqdm

    plan = plan_corpus(seed, sizes)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "raw").mkdir(parents=True)
    # Synthesis forks one child per clip, so it runs before torch is imported: forking a process that holds
    # torch copies a large address space and made generation several times slower.
    raws: list[tuple[Utterance, Path, int]] = []
    for item in tqdm(
        _synthesize_all(plan, tmp / "raw", jobs, seed),
        total=len(plan),
        desc="eSpeak NG synthesis",
        unit="clip",
        disable=not progress,
    ):
        raws.append(item)

    import numpy as np
    import soundfile as sf
    import torch
    import torchaudio

    # One thread: the machine may be shared, and OpenMP spinning on busy cores made this 30x slower.
    torch.set_num_threads(1)
    resamplers: dict[int, torchaudio.transforms.Resample] = {}
    for split in SPLITS:
        (tmp / "wav" / split).mkdir(parents=True)
    rows: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for utt, raw, rate in tqdm(raws, desc="resampling to 16 kHz", unit="clip", disable=not progress):
        pcm = torch.from_numpy(np.frombuffer(raw.read_bytes(), dtype=np.int16).astype(np.float32) / 32768.0)
        if rate not in resamplers:  # the transform computes its filter kernel once
            resamplers[rate] = torchaudio.transforms.Resample(rate, SAMPLE_RATE)
        wav = resamplers[rate](pcm).clamp(-1.0, 1.0).numpy()
        sf.write(tmp / utt.relpath, wav, SAMPLE_RATE, subtype="PCM_16")
        rows[utt.split].append(
            {"audio_filepath": utt.relpath, "text": utt.text, "duration": round(len(wav) / SAMPLE_RATE, 4)}
        )
    shutil.rmtree(tmp / "raw")
    for split in SPLITS:
        with open(tmp / f"{split}.jsonl", "w") as f:
            for row in sorted(rows[split], key=lambda r: r["audio_filepath"]):
                f.write(json.dumps(row) + "\n")
    (tmp / "plan.json").write_text(json.dumps([asdict(u) for u in plan]))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def ensure_corpus(seed: int = 0, sizes: dict[str, int] | None = None, *, progress: bool = True) -> Path:
    """Return the cached corpus folder for (seed, sizes), generating it in a subprocess on first use."""
    sizes = sizes or {"train": 3000, "val": 200, "test": 200}
    out = corpus_dir(seed, sizes)
    if all((out / f"{s}.jsonl").is_file() for s in SPLITS):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Run this file, not `-m audio.corpus`: that imports the `audio` package and with it torch, and forking
    # a synthesis child per clip from a process holding torch copies its address space each time, which
    # made generation much slower for identical bytes (BENCHMARKS.md § ASR recipe).
    script = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    cmd = [sys.executable, "-c", script, str(Path(__file__).resolve()), "--out", str(out)]
    cmd += ["--seed", str(seed)]
    cmd += [f"--{s}={sizes[s]}" for s in SPLITS] + ([] if progress else ["--quiet"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent)] + sys.path))
    # stderr stays attached so the progress bar shows; the child reports its one-line error on stdout.
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        last = [line for line in proc.stdout.strip().splitlines() if line.strip()][-1:]
        raise DataError(f"generating the speech corpus in {out} failed: {' '.join(last) or proc.returncode}")
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI: `python -m audio.corpus --out DIR --seed N --train N --val N --test N`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    for split, n in zip(SPLITS, (3000, 200, 200), strict=True):
        p.add_argument(f"--{split}", type=int, default=n)
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    try:
        sizes = {"train": a.train, "val": a.val, "test": a.test}
        generate_corpus(a.out, a.seed, sizes, jobs=a.jobs, progress=not a.quiet)
    except DataError as e:
        print(e)
        sys.exit(2)


if __name__ == "__main__":
    main()
