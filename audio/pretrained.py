"""The registered speech models that load pretrained weights (`whisper`, `wav2vec2_ctc`, `hubert_ctc`,
`wavlm_ctc`), built as timm's builder does: the plain model from its sizes (a file's own sizes when it gives
them), then `model.weights` mapped onto it by the reader of its format (`audio.checkpoints`). A model's
constructor never reads a file.
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import asdict
from typing import Any

from audio.checkpoints.encoder_files import load_encoder, read_encoder_file
from audio.checkpoints.whisper_files import load_whisper, read_whisper
from audio.wav2vec2 import Wav2Vec2CTC
from audio.whisper import WhisperASR
from core.registry import MODELS, with_model_keywords

log = logging.getLogger(__name__)


def build_whisper(*, weights: str = "", sha256: str = "", **settings: Any) -> WhisperASR:
    """A Whisper built to its sizes, then its pretrained weights loaded.

    weights: a local pretrained Whisper: OpenAI's .pt, a Hugging Face folder or a CTranslate2 folder
        (or `package:NAME/SUB`, an installed package's folder); its sizes replace the ones below.
        Empty: random init (then model.tokenizer is needed)
    sha256: when set, the weights file's SHA-256 must be this (a file a package ships, pinned)
    """
    if not weights:
        return WhisperASR(**settings)
    source = read_whisper(weights, sha256)
    if not settings.get("tokenizer") and source.tokenizer is not None:
        settings["tokenizer"] = str(source.tokenizer)
    model = WhisperASR(**{**settings, **asdict(source.dims)})
    load_whisper(model, source)
    model.file_sizes = asdict(source.dims)
    return model


def build_encoder_ctc(*, weights: str = "", **settings: Any) -> Wav2Vec2CTC:
    """A wav2vec2/HuBERT/WavLM encoder and CTC head built to their sizes, then the encoder's pretrained
    weights loaded.

    weights: a local pretrained file: a torchaudio, fairseq or Hugging Face state dict (.pt/.pth/.bin
        read with weights_only=True, or .safetensors), or a Hugging Face model folder; nothing
        downloads. Where the file says its sizes (config.json beside it, a fairseq cfg/args), they
        replace the size arguments below (SIZE_KEYS); a bare state dict must fit them. The file's head
        is dropped; the encoder loads strictly. Empty: random init
    """
    if not weights:
        return Wav2Vec2CTC(**settings)
    source = read_encoder_file(weights, settings.get("arch", "wav2vec2"))
    if source.sizes:
        defaults = {k: p.default for k, p in inspect.signature(Wav2Vec2CTC).parameters.items()}
        given = {k: _as_size(k, v) for k, v in {**defaults, **settings}.items()}
        changed = {k: v for k, v in source.sizes.items() if given[k] != v}
        log.info(
            "model.weights: sizes from %s%s",
            source.sizes_from,
            ": " + ", ".join(f"model.{k}={_show(v)}" for k, v in changed.items()) if changed else "",
        )
    model = Wav2Vec2CTC(**{**settings, **source.sizes})
    load_encoder(model, source)
    model.file_sizes = dict(source.sizes)
    return model


def _as_size(key: str, value: Any) -> Any:
    """A size setting as a file's sizes spell it (conv layers as tuples of ints), to compare the two."""
    return tuple(tuple(int(x) for x in c) for c in value) if key == "conv_layers" else value


def _show(value: Any) -> str:
    """A size as a command-line override would spell it."""
    if isinstance(value, tuple):
        return json.dumps([list(c) for c in value]).replace(" ", "")
    return str(value).lower() if isinstance(value, bool) else str(value)


MODELS.register_preset(
    "whisper",
    with_model_keywords(build_whisper, WhisperASR),
    "Whisper (tiny.en's sizes by default; model.weights=PATH: OpenAI's .pt, a Hugging Face or CTranslate2 "
    "folder), fine-tuned end to end on raw audio with its own tokenizer and decoder.",
)
with_model_keywords(build_encoder_ctc, Wav2Vec2CTC)
for _name, _arch in (("wav2vec2_ctc", "wav2vec2"), ("hubert_ctc", "hubert"), ("wavlm_ctc", "wavlm")):
    MODELS.register_preset(
        _name,
        build_encoder_ctc,
        f"{_arch} encoder (torchaudio's, base sizes by default; model.weights=PATH: a pretrained file) and a "
        "new CTC head, on raw audio.",
        arch=_arch,
        vocab_size=29,
    )
