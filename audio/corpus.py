"""The embedded speech corpora, generated once and cached: word sequences spoken by eSpeak NG voices
(`espeak_words`, 115 words), and the generation both corpora share. The other corpus, sentences spoken by the
voices of several engines (`voices`), is designed in audio/voices_corpus.py and generated here.

eSpeak NG is GPL-3 and ships in the optional `speech` extra (`espeakng-loader`), so this module never imports
it at module level: `ensure_corpus` runs this file in a subprocess, which keeps the GPL library
out of the training process and forks synthesis children from a small process. Without the extra, an
`espeak-ng` program on PATH is the fallback (one process per clip; other clips than the library's). The
drivers for both are in audio/espeak.py, the other engines' in audio/engines.py (each a program run as a
separate process); this file holds the 115-word corpus's design and the generation around both.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

from core.errors import DataError
from core.files import cache_root, locked

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
    #: the multi-engine corpus's: which engine speaks, whose voice it is, its duration factor (> 1: slower)
    engine: str = "espeak"
    speaker: str = ""
    stretch: float = 1.0

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


_SIBLINGS: dict[str, ModuleType] = {}


def sibling(name: str) -> ModuleType:
    """The module `audio.NAME` (the engine drivers: espeak, engines; the voices corpus's design). Run as a
    file (the generator's subprocess, see ensure_corpus), this module loads them by path: importing
    `audio.NAME` would import the `audio` package, and torch. Loaded so, they find this module under
    `torchkiln_corpus` (audio/voices_corpus.py's CORPUS_BY_PATH)."""
    if __package__:
        return importlib.import_module(f"audio.{name}")
    sys.modules.setdefault("torchkiln_corpus", sys.modules[__name__])
    if name not in _SIBLINGS:
        spec = importlib.util.spec_from_file_location(
            f"torchkiln_{name}", Path(__file__).with_name(f"{name}.py")
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        _SIBLINGS[name] = module
    return _SIBLINGS[name]


class _EspeakBatches:
    """eSpeak NG's driver (audio/espeak.py) behind the engines' interface (audio/engines.py): one clip a
    child, its PCM written directly."""

    name = "espeak"

    def __init__(self, plan: list[Utterance], out: Path, seed: int) -> None:
        """The driver on a data folder with the random speakers added; fails on variants it lacks."""
        self.espeak = sibling("espeak").synthesizer(
            lambda bundled: _overlay_data(bundled, out / "espeak-ng-data", seed)
        )
        self.espeak.check_variants(sorted({u.voice.split("+")[1] for u in plan if u.engine == "espeak"}))

    def batches(self, utts: list[Utterance]) -> list[list[Utterance]]:
        """One clip a child."""
        return [[u] for u in utts]

    def start(self, batch: list[Utterance], folder: Path) -> int:
        """Start the child speaking the batch's clip."""
        return self.espeak.synthesize_to(batch[0], _raw_path(folder, batch[0]))

    def finish(self, batch: list[Utterance], folder: Path) -> list[tuple[Path, int]]:
        """(raw PCM, rate) of the clip."""
        raw = _raw_path(folder, batch[0])
        rate = self.espeak.finish(raw)
        if not raw.is_file():
            raise DataError(f"eSpeak NG wrote no audio for '{batch[0].text}' with voice {batch[0].voice}")
        return [(raw, rate)]


def _raw_path(folder: Path, utt: Utterance) -> Path:
    return folder / f"{utt.split}-{utt.index:06d}.raw"


def _synthesize_all(
    plan: list[Utterance], out: Path, jobs: int, seed: int
) -> Iterator[tuple[Utterance, Path, int]]:
    """Yield (utterance, raw PCM path, sample rate) as the engines' processes finish, `jobs` at a time."""
    engines = sibling("engines")
    drivers: dict[str, object] = {}
    todo: list[tuple[object, list[Utterance]]] = []
    for name in dict.fromkeys(u.engine for u in plan):
        utts = [u for u in plan if u.engine == name]
        driver = _EspeakBatches(plan, out, seed) if name == "espeak" else engines.DRIVERS[name]()
        drivers[name] = driver
        todo += [(driver, batch) for batch in driver.batches(utts)]
    running: dict[int, tuple[object, list[Utterance]]] = {}
    pending = iter(todo)
    while True:
        while len(running) < jobs and (item := next(pending, None)) is not None:
            running[item[0].start(item[1], out)] = item
        if not running:
            return
        pid, status = os.wait()
        driver, batch = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            utt, log = batch[0], getattr(driver, "log", None)
            raise DataError(
                f"{driver.name} failed on '{utt.text}' with voice {utt.voice} (exit code {code}, "
                f"{len(batch)} clips in that process{f'; see {log(batch, out)}' if log else ''})"
            )
        for utt, (raw, rate) in zip(batch, driver.finish(batch, out), strict=True):
            yield utt, raw, rate


def write_corpus(
    out: Path,
    plan: list[Utterance],
    splits: tuple[str, ...],
    *,
    seed: int,
    jobs: int,
    progress: bool,
    row_fields: Callable[[Utterance], dict] = lambda u: {},
    extra_files: dict[str, str] | None = None,
) -> None:
    """Synthesise `plan` into `out` (16 kHz PCM-16 WAV + one JSONL manifest per split), atomically."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "raw").mkdir(parents=True)
    raws = _synthesized(plan, tmp / "raw", jobs, seed, progress)
    rows = _resampled_to_wav(raws, tmp, splits, progress, row_fields)
    shutil.rmtree(tmp / "raw")
    for split in splits:
        with open(tmp / f"{split}.jsonl", "w") as f:
            for row in sorted(rows[split], key=lambda r: r["audio_filepath"]):
                f.write(json.dumps(row) + "\n")
    (tmp / "plan.json").write_text(json.dumps([asdict(u) for u in plan]))
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _synthesized(
    plan: list[Utterance], raw: Path, jobs: int, seed: int, progress: bool
) -> list[tuple[Utterance, Path, int]]:
    """(utterance, raw PCM-16 file in `raw`, its sample rate) of every clip of `plan`, synthesised."""
    from tqdm import tqdm

    # Synthesis forks one child per clip, so it runs before torch is imported: forking a process that holds
    # torch copies a large address space and made generation several times slower.
    engines = ", ".join(dict.fromkeys(u.engine for u in plan)).replace("espeak", "eSpeak NG")
    raws: list[tuple[Utterance, Path, int]] = []
    for item in tqdm(
        _synthesize_all(plan, raw, jobs, seed),
        total=len(plan),
        desc=f"{engines} synthesis",
        unit="clip",
        disable=not progress,
    ):
        raws.append(item)
    return raws


def _resampled_to_wav(
    raws: list[tuple[Utterance, Path, int]],
    tmp: Path,
    splits: tuple[str, ...],
    progress: bool,
    row_fields: Callable[[Utterance], dict],
) -> dict[str, list[dict]]:
    """Each raw clip written as a 16 kHz PCM-16 WAV under `tmp`; the manifest rows per split."""
    import numpy as np
    import soundfile as sf
    import torch
    import torchaudio
    from tqdm import tqdm

    # One thread: the machine may be shared, and OpenMP spinning on busy cores made this 30x slower.
    torch.set_num_threads(1)
    resamplers: dict[int, torchaudio.transforms.Resample] = {}
    for split in splits:
        (tmp / "wav" / split).mkdir(parents=True)
    rows: dict[str, list[dict]] = {s: [] for s in splits}
    for utt, raw, rate in tqdm(raws, desc="resampling to 16 kHz", unit="clip", disable=not progress):
        pcm = torch.from_numpy(np.frombuffer(raw.read_bytes(), dtype=np.int16).astype(np.float32) / 32768.0)
        if rate == SAMPLE_RATE:
            wav = pcm.numpy()
        else:
            if rate not in resamplers:  # the transform computes its filter kernel once
                resamplers[rate] = torchaudio.transforms.Resample(rate, SAMPLE_RATE)
            wav = resamplers[rate](pcm).clamp(-1.0, 1.0).numpy()
        sf.write(tmp / utt.relpath, wav, SAMPLE_RATE, subtype="PCM_16")
        rows[utt.split].append(
            {
                "audio_filepath": utt.relpath,
                "text": utt.text,
                "duration": round(len(wav) / SAMPLE_RATE, 4),
                **row_fields(utt),
            }
        )
    return rows


def generate_corpus(
    out: Path, seed: int, sizes: dict[str, int], *, jobs: int = 2, progress: bool = True
) -> None:
    """Synthesise the eSpeak NG corpus into `out` (16 kHz PCM-16 WAV + one JSONL manifest per split),
    atomically."""
    plan = plan_corpus(seed, sizes)
    write_corpus(out, plan, SPLITS, seed=seed, jobs=jobs, progress=progress)


def ensure_corpus(seed: int = 0, sizes: dict[str, int] | None = None, *, progress: bool = True) -> Path:
    """Return the cached corpus folder for (seed, sizes), generating it in a subprocess on first use."""
    sizes = sizes or {"train": 3000, "val": 200, "test": 200}
    out = corpus_dir(seed, sizes)
    args = ["--seed", str(seed)] + [f"--{s}={sizes[s]}" for s in SPLITS]
    return ensure_generated(out, SPLITS, args, progress=progress)


def ensure_generated(out: Path, splits: tuple[str, ...], args: list[str], *, progress: bool) -> Path:
    """`out`, generated first (by this file run with `args`) unless it is complete."""
    if _complete(out, splits):
        return out
    # Ranks and sweep jobs started together wait for one generator instead of each replacing the folder
    # the others may already be reading.
    with locked(cache_root() / "locks" / f"{out.name}.lock"):
        if not _complete(out, splits):
            _generate_in_child(out, args, progress=progress)
    return out


def _complete(out: Path, splits: tuple[str, ...] = SPLITS) -> bool:
    """True when every split's manifest of the corpus in `out` is there (the folder is renamed in whole)."""
    return all((out / f"{s}.jsonl").is_file() for s in splits)


def _generate_in_child(out: Path, args: list[str], *, progress: bool) -> None:
    """Run this file's `main` with `--out out` and `args` in a fresh interpreter; a one-line DataError if it
    fails."""
    # Run this file, not `-m audio.corpus`: that imports the `audio` package and with it torch, and forking
    # a synthesis child per clip from a process holding torch copies its address space each time, which
    # made generation much slower for identical bytes (BENCHMARKS.md § ASR recipe).
    script = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    cmd = [sys.executable, "-c", script, str(Path(__file__).resolve()), "--out", str(out), *args]
    cmd += [] if progress else ["--quiet"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent)] + sys.path))
    # stderr stays attached so the progress bar shows; the child reports its one-line error on stdout.
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        last = [line for line in proc.stdout.strip().splitlines() if line.strip()][-1:]
        raise DataError(f"generating the speech corpus in {out} failed: {' '.join(last) or proc.returncode}")


def main(argv: list[str] | None = None) -> None:
    """CLI: `PYTHONPATH=. python audio/corpus.py --out DIR --seed N --train N --val N --test N`, or
    `--out DIR --voices SETTINGS_JSON` (the multi-engine corpus)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    for split, n in zip(SPLITS, (3000, 200, 200), strict=True):
        p.add_argument(f"--{split}", type=int, default=n)
    p.add_argument("--voices", help="the multi-engine corpus's settings (VoicesSettings.to_json)")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    try:
        if a.voices:
            voices = sibling("voices_corpus")
            settings = voices.VoicesSettings.from_json(a.voices)
            voices.generate_voices(a.out, settings, jobs=a.jobs, progress=not a.quiet)
        else:
            sizes = {"train": a.train, "val": a.val, "test": a.test}
            generate_corpus(a.out, a.seed, sizes, jobs=a.jobs, progress=not a.quiet)
    except DataError as e:
        print(e)
        sys.exit(2)


if __name__ == "__main__":
    main()
