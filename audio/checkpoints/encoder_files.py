"""A wav2vec 2.0 / HuBERT / WavLM weights file (`model.weights=PATH`): a torchaudio, fairseq or Hugging Face
state dict (.pt/.pth/.bin read with weights_only=True, or .safetensors), or a Hugging Face model folder; read
with the sizes its own config gives (a folder's config.json, a fairseq checkpoint's cfg or args), then its
encoder loaded strictly into a `Wav2Vec2CTC` built to them. The file's own output head is dropped."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from audio.checkpoints import fairseq, hf
from audio.checkpoints.json_files import json_object
from audio.checkpoints.torchaudio_layout import detect_layout, to_torchaudio
from audio.wav2vec2 import ARCHS, EXTRACTOR_MODES, Wav2Vec2CTC
from core.checkpoint import load_model_state
from core.checkpoint.weights import read_weights_file, state_dict_in
from core.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncoderFile:
    """A pretrained file as read: its state dict, key layout, and the sizes its own config gives (empty when
    it has none), with where those came from."""

    path: str
    state: dict[str, torch.Tensor]
    layout: str
    sizes: dict[str, Any]
    sizes_from: str


def read_encoder_file(path: str, arch: str) -> EncoderFile:
    """`model.weights=path` read for model.arch=`arch`: a weights file, or a Hugging Face model folder
    (config.json beside model.safetensors or pytorch_model.bin). Nothing in it runs."""
    file = Path(path).expanduser()
    if file.is_dir():
        found = [file / name for name in hf.WEIGHT_FILES if (file / name).is_file()]
        if not found:
            raise ConfigError(
                f"model.weights={path} is a folder without {' or '.join(hf.WEIGHT_FILES)}; give the weights "
                "file or a Hugging Face model folder",
                key="model.weights",
                value=str(path),
                valid=hf.WEIGHT_FILES,
            )
        file = found[0]
    raw = read_weights_file(str(file), "model.weights")
    state = state_dict_in(raw, path, "model.weights")
    layout = detect_layout(state, path)
    sizes, sizes_from, file_arch = _file_sizes(raw, file, path)
    if file_arch and (file_arch == "wavlm") != (arch == "wavlm"):
        raise ConfigError(
            f"model.weights={path} is a {file_arch} model ({sizes_from}) and model.arch={arch}; use "
            f"model={file_arch}_ctc",
            key="model.arch",
            value=arch,
            valid=(file_arch,),
        )
    return EncoderFile(str(path), state, layout, sizes, sizes_from)


def _file_sizes(raw: Any, file: Path, path: str) -> tuple[dict[str, Any], str, str]:
    """(the sizes the file's config gives, where they are, the architecture it names: '' if unknown); all
    empty when the file has no config: a bare state dict, built to the run's model.* keys."""
    if isinstance(raw, dict) and ("cfg" in raw or "args" in raw):
        model, task = fairseq.configs(raw)
        if model is not None:
            where = "the file's fairseq config"
            return _checked(fairseq.sizes(model, task), path, where), where, fairseq.arch(model)
    config = file.parent / "config.json"
    if file.suffix in (".safetensors", ".bin") and config.is_file():  # a Hugging Face model folder
        own = json_object(config, "model.weights", path)
        if own.get("model_type") not in ARCHS:
            raise ConfigError(
                f"model.weights={path}: {config} is a model_type={own.get('model_type')} model; the encoders "
                f"here are {', '.join(ARCHS)}",
                key="model.weights",
                value=str(path),
                valid=ARCHS,
            )
        pre = file.parent / "preprocessor_config.json"
        normalize = json_object(pre, "model.weights", path).get("do_normalize") if pre.is_file() else None
        sizes = _checked(hf.encoder_sizes(own, normalize), path, str(config))
        return sizes, str(config), str(own["model_type"])
    return {}, "", ""


def _checked(sizes: dict[str, Any], path: str, where: str) -> dict[str, Any]:
    """`sizes` as the model's types, or one ConfigError naming the first setting of the file's config that
    is not a size this model can take."""
    flags = ("conv_bias", "layer_norm_first", "normalize_audio")
    out: dict[str, Any] = {}
    for k, v in sizes.items():
        if k in flags:
            ok = isinstance(v, bool)
        elif k == "extractor_mode":
            ok = v in EXTRACTOR_MODES
        elif k == "conv_layers":
            ok = bool(v) and all(len(c) == 3 and all(isinstance(x, int) and x > 0 for x in c) for c in v)
        else:
            ok = isinstance(v, int) and not isinstance(v, bool) and v > 0
        if not ok:
            raise CheckpointError(
                f"model.weights={path}: {where} gives model.{k}={v!r}, not one this model can be built to",
                key="model.weights",
                value=str(path),
                valid=(f"model.{k}",),
            )
        out[k] = tuple(tuple(c) for c in v) if k == "conv_layers" else v
    return out


def load_encoder(model: Wav2Vec2CTC, source: EncoderFile) -> None:
    """The encoder (and mask embedding, when the file has one) from `source` into `model`, strictly: any
    tensor the file lacks, has extra or has in another shape is a CheckpointError naming the first ones. The
    head keeps its fresh initialisation; the log names what was loaded, what was dropped and what is new."""
    path, layout = source.path, source.layout
    encoder, mask, dropped = to_torchaudio(
        source.state, layout, model.arch, len(model.encoder.transformer.layers)
    )
    own = {k: v for k, v in model.state_dict().items() if k.startswith(("feature_extractor.", "encoder."))}
    # in the model's order, so the first named is the first layer that differs
    problems = [
        f"{k} missing from the file"
        if k not in encoder
        else f"{k} is {tuple(encoder[k].shape)} in the file, {tuple(v.shape)} here"
        for k, v in own.items()
        if k not in encoder or encoder[k].shape != v.shape
    ]
    problems += [f"{k} unknown to model.arch={model.arch}" for k in encoder if k not in own]
    if mask is not None and mask.shape != model.mask_embedding.shape:
        problems.append(
            f"mask_embedding is {tuple(mask.shape)} in the file, {tuple(model.mask_embedding.shape)}"
        )
    if problems:
        raise CheckpointError(
            f"model.weights={path} ({layout} layout) does not fit model.arch={model.arch} at these sizes: "
            f"{'; '.join(problems[:3])}{f' (+{len(problems) - 3} more)' if len(problems) > 3 else ''}; "
            "set model.dim/layers/heads/ff_dim/conv_layers/... to the file's",
            key="model.weights",
            value=str(path),
            valid=tuple(problems[:3]),
        )
    new = ["head.weight", "head.bias"] + ([] if mask is not None else ["mask_embedding"])
    full = {**encoder, "mask_embedding": model.mask_embedding.detach() if mask is None else mask}
    full |= {k: v for k, v in model.state_dict().items() if k.startswith("head.")}
    load_model_state(model, full, path)
    log.info(
        "model.weights: %d encoder tensors of model.arch=%s from %s (%s layout); new: %s (vocab %d)%s",
        len(encoder),
        model.arch,
        path,
        layout,
        ", ".join(new),
        model.vocab_size,
        f"; dropped from the file: {', '.join(dropped[:6])}{' ...' if len(dropped) > 6 else ''}"
        if dropped
        else "",
    )
