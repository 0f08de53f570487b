"""`python -m recipes.transcribe ckpt=RUN_DIR audio=FILE`: print the transcript of a wav/flac file.

RUN_DIR is the output folder of `python -m recipes.train +task=asr`: its `.hydra/config.yaml` rebuilds the
task and model, and `model.safetensors` holds the trained weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import soundfile as sf
import torch

from core.errors import DataError, TorchkilnError
from recipes.runs import load_run

USAGE = "usage: python -m recipes.transcribe ckpt=RUN_DIR audio=FILE.wav"


def transcribe(run_dir: str | Path, audio_path: str | Path) -> str:
    """Transcript of `audio_path` by the ASR model trained in `run_dir`."""
    run = load_run(run_dir, tasks=("asr",), command="recipes.transcribe")
    task, model = run.task, run.model
    try:
        data, rate = sf.read(str(audio_path), dtype="float32", always_2d=True)
    except Exception as e:  # soundfile raises several types for missing or foreign files
        raise DataError(
            f"cannot read {audio_path} as audio ({type(e).__name__}); give a wav or flac file"
        ) from None
    if data.shape[0] == 0:
        raise DataError(f"{audio_path} holds no samples")
    wav = torch.from_numpy(data.mean(axis=1))  # a stereo file is mixed down rather than refused
    return task.transcribe(model, wav, rate)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: `ckpt=` and `audio=` as key=value arguments, like the training recipe."""
    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv) if "=" in a)
    if "ckpt" not in args or "audio" not in args:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        print(transcribe(args["ckpt"], args["audio"]))
    except TorchkilnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
