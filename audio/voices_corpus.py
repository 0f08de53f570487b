"""The multi-engine speech corpus (`data=voices`): sentences from the shipped KJV (or the 115-word preset's
vocabulary) spoken by the installed voices of several engines (eSpeak NG, flite, Festival, Piper; each
optional), split by speaker and by engine, generated once and cached.

The generation machinery is audio/corpus.py's (the eSpeak NG corpus's): its generator subprocess runs that
file by path, without the `audio` package and torch, and loads this one by path too (`corpus.sibling`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import lzma
import random
import re
import shutil
import sys
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from core.errors import ConfigError, DataError
from core.files import cache_root

if TYPE_CHECKING:
    from audio.corpus import Utterance

#: the name audio/corpus.py registers itself under when it runs by path (see `corpus.sibling`)
CORPUS_BY_PATH = "torchkiln_corpus"


def _corpus() -> ModuleType:
    """audio/corpus.py, whose utterances, accents and generation this corpus shares: the package's module,
    or, inside the generator's subprocess (both files loaded by path), the one that loaded this."""
    return importlib.import_module("audio.corpus") if __package__ else sys.modules[CORPUS_BY_PATH]


#: Bumped whenever the multi-engine corpus's plan or synthesis changes, so stale caches are never reused.
VOICES_VERSION = 1
VOICE_SPLITS = ("train", "val", "test_engine")
#: every engine the corpus knows, in the order of its speakers' plan
ENGINE_NAMES = ("espeak", "flite", "festival", "piper")
#: `test_engine=auto` holds out the first of these installed that leaves another engine to train on: Piper,
#: whose one voice can only be held out whole (flite's and Festival's several train, their people split)
TEST_ENGINE_ORDER = ("piper",)
#: the transcripts: sentences of the King James Bible (open vocabulary) or the 115-word preset's sequences
TEXTS = ("kjv", "words115")
#: speakers whose voices (in every engine) only speak in `val`: one recorded voice of flite, one of Festival
VAL_SPEAKERS = ("awb", "ked")
#: words in a KJV sentence: a run of this many consecutive words of a verse (a shorter verse whole)
KJV_WORDS = (3, 10)
#: verses whose crc32(reference) % KJV_POOL_MOD is 0 give val's sentences, 1 test_engine's, the rest train's
KJV_POOL_MOD = 20
#: the text LM task's KJV file; read here directly (lzma TSV), since the generator imports no package
KJV_PATH = Path(__file__).resolve().parent.parent / "text" / "data" / "kjv.tsv.xz"
#: duration factors of the recorded-voice engines' clips (Piper's are rounded to 0.05: one process each)
STRETCH = (0.85, 1.2)


@dataclass(frozen=True)
class VoicesSettings:
    """Everything the multi-engine corpus is a function of (its cache key): resolved, not as configured."""

    seed: int
    sizes: dict[str, int]
    #: the engines that speak in train and val
    engines: tuple[str, ...]
    #: the engine that only speaks in test_engine ("" : none)
    test_engine: str
    text: str
    val_speakers: tuple[str, ...]
    #: (engine, voice, speaker) of every installed voice of those engines
    voices: tuple[tuple[str, str, str], ...] = field(default=())

    def to_json(self) -> str:
        """The settings as JSON (what the generator child is given, and the cache key's source)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> VoicesSettings:
        """Settings from `to_json`'s text."""
        d = json.loads(text)
        return cls(
            seed=d["seed"],
            sizes=d["sizes"],
            engines=tuple(d["engines"]),
            test_engine=d["test_engine"],
            text=d["text"],
            val_speakers=tuple(d["val_speakers"]),
            voices=tuple(tuple(v) for v in d["voices"]),
        )


def espeak_installed() -> bool:
    """Whether an eSpeak NG driver is here (espeakng-loader, found but not imported, or espeak-ng on PATH)."""
    return importlib.util.find_spec("espeakng_loader") is not None or shutil.which("espeak-ng") is not None


def installed_voices(engine: str) -> list[tuple[str, str, str]]:
    """(engine, voice, speaker) of each installed voice of `engine` ([] if it is not installed)."""
    if engine == "espeak":
        return [("espeak", v, f"espeak-{v}") for v in _corpus().VARIANTS] if espeak_installed() else []
    return [(v.engine, v.name, v.speaker) for v in _corpus().sibling("engines").find_voices(engine)]


def resolve_voices(
    seed: int,
    sizes: dict[str, int],
    *,
    engines: list[str] | tuple[str, ...] = (),
    test_engine: str = "auto",
    text: str = "kjv",
    val_speakers: list[str] | tuple[str, ...] = VAL_SPEAKERS,
) -> tuple[VoicesSettings, str]:
    """The corpus's settings for what is installed here, and the one log line that says what it uses.

    `engines` empty: every installed engine but the test engine; named: each must be installed (a one-line
    DataError naming it and how to install it). `test_engine`: auto (the first installed of
    TEST_ENGINE_ORDER that leaves an engine to train on), none, or an engine, which must be installed.
    """
    _check_names(engines, test_engine, text)
    found = {e: installed_voices(e) for e in ENGINE_NAMES}
    have = tuple(e for e in ENGINE_NAMES if found[e])
    engine_list = _corpus().sibling("engines")
    for key, name in [("data.engines", e) for e in engines] + [("data.test_engine", test_engine)]:
        if name in ENGINE_NAMES and not found[name]:
            raise DataError(
                engine_list.missing_message(name).replace("data.engines", key),
                key=key,
                value=name,
                valid=have,
            )
    train, held = _train_and_held(engines, test_engine, have, engine_list)
    voices = tuple(v for e in (*train, *([held] if held else [])) for v in found[e])
    # without a held-out engine its size would only split the cache
    sizes = {**sizes, "test_engine": sizes["test_engine"] if held else 0}
    settings = VoicesSettings(seed, sizes, train, held, text, tuple(val_speakers), voices)
    plan_pools(settings)  # a split left without voices fails here, in one line
    count = {e: sum(v[0] == e for v in voices) for e in ENGINE_NAMES}
    missing = [e for e in ENGINE_NAMES if not found[e]]
    line = "voices corpus: training engines " + ", ".join(f"{e} ({_voices(count[e])})" for e in train)
    line += f"; test_engine: {f'{held} ({_voices(count[held])})' if held else 'none'}"
    line += f"; not installed: {', '.join(missing)}" if missing else ""
    return settings, line


def _check_names(engines: list[str] | tuple[str, ...], test_engine: str, text: str) -> None:
    """The ConfigError for an engine, test engine or text that is none of the known ones."""
    for key, names in (("data.engines", list(engines)), ("data.test_engine", [test_engine])):
        for name in names:
            if name not in ENGINE_NAMES and not (key == "data.test_engine" and name in ("auto", "none")):
                valid = ENGINE_NAMES + (("auto", "none") if key == "data.test_engine" else ())
                raise ConfigError(
                    f"{key}: {name} is unknown; valid: {', '.join(valid)}", key=key, value=name, valid=valid
                )
    if text not in TEXTS:
        raise ConfigError(
            f"data.text={text} is unknown; valid: {', '.join(TEXTS)}",
            key="data.text",
            value=text,
            valid=TEXTS,
        )


def _train_and_held(
    engines: list[str] | tuple[str, ...], test_engine: str, have: tuple[str, ...], engine_list: ModuleType
) -> tuple[tuple[str, ...], str]:
    """(training engines, held-out test engine or "") from the ones asked and the ones installed (`have`)."""
    if test_engine == "auto":
        rest = [e for e in have if e not in engines]
        test_engine = next(
            (e for e in TEST_ENGINE_ORDER if e in rest and any(x != e for x in (engines or have))), "none"
        )
    held = "" if test_engine == "none" else test_engine
    train = tuple(engines) or tuple(e for e in have if e != held)
    if held in train:
        raise ConfigError(
            f"data.test_engine={held} is also in data.engines; an engine is trained on or held out, not both",
            key="data.test_engine",
            value=held,
            valid=tuple(e for e in have if e not in train),
        )
    if not train:
        raise DataError(
            "no speech engine is installed for the voices corpus; "
            + "; or ".join(engine_list.ENGINES[e].install for e in ENGINE_NAMES),
            key="data.engines",
            value="",
            valid=have,
        )
    return train, held


def _voices(n: int) -> str:
    return f"{n} voice" if n == 1 else f"{n} voices"


def voices_dir(settings: VoicesSettings) -> Path:
    """Cache folder of the multi-engine corpus of `settings` (a digest of them names it)."""
    digest = hashlib.sha256(settings.to_json().encode()).hexdigest()[:12]
    return cache_root() / "data" / f"voices-v{VOICES_VERSION}-{settings.text}-seed{settings.seed}-{digest}"


def plan_pools(settings: VoicesSettings) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """Split -> engine -> its (voice, speaker)s that speak there: a val speaker's voices speak only in val,
    the others' (of the training engines) in train; every voice of the test engine in test_engine. eSpeak
    NG's held-out variants (a seeded HELD_OUT_VARIANTS) are its val speakers."""
    rng = random.Random(f"voices/{settings.seed}/speakers")
    variants = sorted(_corpus().VARIANTS)
    rng.shuffle(variants)
    held_variants = {f"espeak-{v}" for v in variants[: _corpus().HELD_OUT_VARIANTS]}
    val_speakers = set(settings.val_speakers) | held_variants
    pools: dict[str, dict[str, list[tuple[str, str]]]] = {s: {} for s in VOICE_SPLITS}
    for engine, voice, speaker in settings.voices:
        if engine == settings.test_engine:
            split = "test_engine"
        else:
            split = "val" if speaker in val_speakers else "train"
        pools[split].setdefault(engine, []).append((voice, speaker))
    for engine in settings.engines:
        if engine not in pools["train"]:
            raise DataError(
                f"data.val_speakers holds out every voice of {engine}; leave it one to train on",
                key="data.val_speakers",
                value=",".join(settings.val_speakers),
                valid=tuple(s for e, _, s in settings.voices if e == engine),
            )
    if settings.sizes["val"] and not pools["val"]:
        raise DataError(
            f"no voice of {', '.join(settings.engines)} belongs to data.val_speakers; name one of theirs",
            key="data.val_speakers",
            value=",".join(settings.val_speakers),
            valid=tuple(s for e, _, s in settings.voices if e in settings.engines),
        )
    return pools


def normalize_text(text: str) -> str:
    """Lower case, letters, apostrophes and single spaces (audio.ctc.normalize_transcript's alphabet; the
    KJV holds no digits). Kept here because the generator imports no package."""
    return " ".join(re.sub(r"[^a-z' ]+", " ", text.lower()).replace(" '", " ").replace("' ", " ").split())


@functools.lru_cache(maxsize=1)
def kjv_sentences() -> dict[str, list[list[str]]]:
    """The words of each KJV verse, by the split its sentences go to (a hash of its reference decides);
    read only."""
    if not KJV_PATH.is_file():
        raise DataError(f"{KJV_PATH} is missing; data.text=words115 needs no KJV, or restore the file")
    pools: dict[str, list[list[str]]] = {s: [] for s in VOICE_SPLITS}
    for line in lzma.decompress(KJV_PATH.read_bytes()).decode("utf-8").splitlines():
        book, chapter, verse, text = line.split("\t")
        h = zlib.crc32(f"{book} {chapter}:{verse}".encode()) % KJV_POOL_MOD
        words = normalize_text(text).split()
        if words:
            pools[VOICE_SPLITS[h + 1] if h < 2 else "train"].append(words)
    return pools


def plan_voices(settings: VoicesSettings) -> list[Utterance]:
    """Every utterance of the multi-engine corpus, a pure function of `settings`.

    Each clip draws its engine (uniformly among those speaking in its split), then a voice of it. eSpeak NG
    clips get a random accent, rate and pitch as in the 115-word corpus (half its training clips random
    speakers); the others a duration factor in STRETCH. Held-out sentences never occur in train (nor in
    each other): KJV ones come from verses of their own.
    """
    base = _corpus()
    pools = plan_pools(settings)
    rng = random.Random(f"voices/{settings.seed}/plan")
    verses = kjv_sentences() if settings.text == "kjv" else None
    seen: set[str] = set()
    plan: list[Utterance] = []
    for split in VOICE_SPLITS:
        if not pools[split]:
            continue
        engines = sorted(pools[split], key=ENGINE_NAMES.index)
        split_seen: set[str] = set()
        for index in range(settings.sizes[split]):
            for _ in range(1000):
                if verses is None:
                    text = " ".join(rng.choices(base.VOCABULARY, k=rng.randint(1, 6)))
                else:
                    words = rng.choice(verses[split])
                    n = min(len(words), rng.randint(*KJV_WORDS))
                    start = rng.randrange(len(words) - n + 1)
                    text = " ".join(words[start : start + n])
                if split == "train" or text not in seen:
                    break
            else:
                raise DataError(f"cannot draw {settings.sizes[split]} unseen sentences for split '{split}'")
            split_seen.add(text)
            engine = rng.choice(engines)
            voice, speaker = rng.choice(pools[split][engine])
            seed = zlib.crc32(f"{settings.seed}/{split}/{index}".encode())
            if engine == "espeak":
                if split == "train" and rng.random() < base.RANDOM_SPEAKER_FRACTION:
                    voice = f"tk{rng.randrange(base.RANDOM_SPEAKERS):03d}"
                    speaker = f"espeak-{voice}"
                utt = base.Utterance(
                    split,
                    index,
                    text,
                    f"{rng.choice(base.ACCENTS)}+{voice}",
                    rng.randint(130, 200),
                    rng.randint(30, 70),
                    rng.randint(30, 80),
                    seed,
                    engine,
                    speaker,
                )
            else:
                stretch = rng.uniform(*STRETCH)
                stretch = round(round(stretch * 20) / 20 if engine == "piper" else stretch, 2)
                utt = base.Utterance(split, index, text, voice, 0, 0, 0, seed, engine, speaker, stretch)
            plan.append(utt)
        seen |= split_seen
    return plan


def generate_voices(out: Path, settings: VoicesSettings, *, jobs: int = 2, progress: bool = True) -> None:
    """Synthesise the multi-engine corpus into `out`: 16 kHz WAVs, a manifest per split whose rows also
    name each clip's engine and speaker, the settings (settings.json); atomically."""
    plan = plan_voices(settings)
    splits = tuple(s for s in VOICE_SPLITS if any(u.split == s for u in plan) or s != "test_engine")
    _corpus().write_corpus(
        out,
        plan,
        splits,
        seed=settings.seed,
        jobs=jobs,
        progress=progress,
        row_fields=lambda u: {"engine": u.engine, "speaker": u.speaker},
        extra_files={"settings.json": settings.to_json() + "\n"},
    )


def ensure_voices(settings: VoicesSettings, *, progress: bool = True) -> Path:
    """Return the cached multi-engine corpus folder of `settings`, generating it in a subprocess first."""
    splits = VOICE_SPLITS if settings.test_engine else VOICE_SPLITS[:2]
    args = ["--voices", settings.to_json()]
    return _corpus().ensure_generated(voices_dir(settings), splits, args, progress=progress)
