"""`python -m recipes.transcribe ckpt=RUN_DIR audio=FILE|DIR|MANIFEST [decoder=greedy]`: transcripts by a
trained speech recognizer.

RUN_DIR is the output folder of `python -m recipes.train +task=asr` (or one of its checkpoints/step_*
folders). This is `recipes.predict` for asr runs, printed rather than written: one audio file prints its
transcript; a folder of audio files or a JSONL manifest (audio_filepath[, text]) prints one JSON line per
file (path, text[, reference]), then, where the manifest gives references, WER and CER on stderr.
`decoder=` decodes with another of the task's decoders than the run's (its `task.decoder`); `task.KEY=VALUE`
changes another task setting, e.g. task.beam_size=4.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from audio.asr import DECODERS, MANIFEST_SUFFIXES
from core.bounds import Bounds
from core.errors import ConfigError, unknown_choice
from recipes.cli.command import command
from recipes.cli.options import check, fields_of, help_text, parse_args, require
from recipes.cli.runs import load_run
from recipes.predict import predict_items

USAGE = "usage: python -m recipes.transcribe ckpt=RUN_DIR audio=FILE|DIR|MANIFEST [decoder=greedy] [...]"


@dataclass
class TranscribeOptions:
    """The command's keys."""

    #: the asr run directory (its model.safetensors), or one of its checkpoints/step_* folders
    ckpt: str = ""
    #: a wav/flac file, a folder of audio files, or a JSONL manifest (audio_filepath[, text])
    audio: str = ""
    #: greedy, lexicon, beam or beam_lexicon (the beam ones need flashlight-text); empty: the run's own
    decoder: str = ""
    #: files per forward pass
    batch_size: Annotated[int, Bounds(ge=1)] = 16
    #: cpu, cuda, cuda:N, mps or auto; empty: the run's own device setting
    device: str = ""


def transcribe(run_dir: str | Path, audio_path: str | Path, decoder: str = "") -> str:
    """Transcript of the audio file `audio_path` by the ASR model trained in `run_dir`."""
    overrides = [f"task.decoder={decoder}"] if decoder else []
    loaded = load_run(run_dir, tasks=("asr",), command="recipes.transcribe", overrides=overrides)
    items = loaded.task.prediction_inputs(Path(audio_path).expanduser())
    return predict_items(loaded, items[:1], batch_size=1)[0]["text"]


def run(argv: list[str]) -> int:
    """The command: print the transcript(s)."""
    values, overrides = parse_args(argv, fields_of(TranscribeOptions), usage=USAGE, sections=("task",))
    opts = TranscribeOptions(**check(values, TranscribeOptions))
    require(values, ("ckpt", "audio"), USAGE)
    if opts.decoder:
        if opts.decoder not in DECODERS:
            raise unknown_choice("decoder", opts.decoder, DECODERS)
        if any(o.startswith("task.decoder=") for o in overrides):
            raise ConfigError("decoder= and task.decoder= are the same setting; give one of them")
        overrides.append(f"task.decoder={opts.decoder}")
    loaded = load_run(
        opts.ckpt, device=opts.device, tasks=("asr",), command="recipes.transcribe", overrides=overrides
    )
    source = Path(opts.audio).expanduser()
    items = loaded.task.prediction_inputs(source)
    rows = predict_items(loaded, items, batch_size=opts.batch_size)
    if source.is_file() and source.suffix.lower() not in MANIFEST_SUFFIXES:
        print(rows[0]["text"], flush=True)
        return 0
    for row in rows:
        print(json.dumps(row, ensure_ascii=False), flush=True)
    scores = loaded.task.prediction_summary(items, rows)
    if scores:
        print(" ".join(f"{k}={v:.4g}" for k, v in scores.items()), file=sys.stderr, flush=True)
    return 0


def describe() -> str:
    """`--help`: the keys."""
    doc = __doc__.split("\n\n", 1)[1].strip()
    return help_text(USAGE, doc, [("keys", TranscribeOptions)])


main = command(run, usage=USAGE, describe=describe)

if __name__ == "__main__":
    sys.exit(main())
