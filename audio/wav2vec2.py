"""Pretrained speech encoders (wav2vec 2.0, HuBERT, WavLM) fine-tuned with a new CTC head, on raw audio.

The encoder is torchaudio's (`torchaudio.models.wav2vec2_model` / `wavlm_model`, the builders of its
pretrained bundles), so a published checkpoint of any of the three loads into it: `model.weights=PATH` reads a
torchaudio, fairseq or Hugging Face state dict (`weights_only=True` or safetensors: nothing in the file runs)
and renames its keys to torchaudio's with torchaudio's own fairseq key map. The file's own output head (a
pretraining projection or another vocabulary's CTC layer) is dropped: the head here is new, sized for the
task's tokenizer. Where the file says its own sizes (a Hugging Face folder's config.json, a fairseq
checkpoint's cfg or args), the encoder is built to them, so `model=wav2vec2_ctc model.weights=PATH` loads a
base or a large model alike.

Fine-tuning follows fairseq's and Hugging Face's wav2vec 2.0 recipes: the convolutional feature encoder
frozen, the Transformer frozen for the first `freeze_encoder_steps` updates (fairseq's
freeze_finetune_updates), time spans of the encoder's input replaced by the learned mask embedding while
training (mask_time_prob), whole Transformer layers skipped at random (layer drop), and a learning rate for
the encoder that is a fraction of the head's (`lr_scale()`, read by core.optim).
"""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn

from core.bounds import Bounds
from core.checkpoint import load_model_state
from core.checkpoint.weights import read_weights_file, state_dict_in
from core.errors import CheckpointError, ConfigError
from core.loop.callbacks import Callback
from core.registry import MODELS

log = logging.getLogger(__name__)

ARCHS = ("wav2vec2", "hubert", "wavlm")
EXTRACTOR_MODES = ("group_norm", "layer_norm")
#: the base models' feature encoder, (channels, kernel, stride) per layer: 20 ms frames at 16 kHz
BASE_CONV = ((512, 10, 5),) + ((512, 3, 2),) * 4 + ((512, 2, 2),) * 2
LAYOUTS = ("torchaudio", "fairseq", "huggingface")
#: torchaudio's key of the positional convolution's weight-norm parts: magnitude (g) and direction (v)
_POS_CONV = "encoder.transformer.pos_conv_embed.conv."
_WEIGHT_NORM = {
    "weight_g": "parametrizations.weight.original0",
    "weight_v": "parametrizations.weight.original1",
}
#: what a file holds besides the encoder, by layout: output heads and pretraining-only parts, never loaded
_DROPPED = re.compile(
    r"^(aux|head|lm_head|proj|final_proj|project_q|project_hid|quantizer|label_embs_concat|target_glu)(\.|$)"
)
#: the learned mask embedding's name in each layout (torchaudio's builders have none; this module's is kept)
_MASK_KEYS = ("mask_embedding", "mask_emb", "masked_spec_embed")
#: the model's settings a pretrained file's own config decides (its dropouts and the fine-tuning settings
#: stay the run's): the network's shape, and whether the waveforms are normalized first
SIZE_KEYS = (
    "extractor_mode",
    "conv_layers",
    "conv_bias",
    "dim",
    "layers",
    "heads",
    "ff_dim",
    "pos_conv_kernel",
    "pos_conv_groups",
    "layer_norm_first",
    "num_buckets",
    "max_distance",
    "normalize_audio",
)
#: a Hugging Face folder's weights, in the order transformers' from_pretrained prefers them
_HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


class UpdateCounter(Callback):
    """Tells every module with a `set_num_updates(step)` method (fairseq's convention) the optimizer step the
    run is at, before the first step (a resumed run's too) and after each."""

    def on_fit_start(self, trainer: Any) -> None:
        """Start at the run's step (0, or a resumed run's)."""
        self._tell(trainer)

    def on_step_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        """Count the step just taken."""
        self._tell(trainer)

    @staticmethod
    def _tell(trainer: Any) -> None:
        for m in trainer.model.modules():
            if callable(getattr(m, "set_num_updates", None)):
                m.set_num_updates(trainer.state.step)


def time_mask(lengths: torch.Tensor, frames: int, prob: float, span: int) -> torch.Tensor:
    """(B, frames) bool, True on masked frames: each real frame starts a span of `span` frames with
    probability prob / span, so about 1 - exp(-prob) of the frames are masked (fairseq's mask_prob counts
    overlapping spans the same way); never a padding frame."""
    real = torch.arange(frames, device=lengths.device)[None, :] < lengths[:, None]
    starts = (torch.rand(real.shape, device=lengths.device) < prob / span) & real
    # a frame is masked when a span started within the `span` frames up to it: a max over that window
    covered = F.max_pool1d(F.pad(starts[:, None].float(), (span - 1, 0)), span, stride=1)[:, 0]
    return covered.bool() & real


def _normalized(audio: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each waveform at zero mean and unit variance over its real samples (padding stays zero), as the
    large models' feature extractors normalize (Hugging Face's do_normalize, fairseq's normalize)."""
    real = (torch.arange(audio.shape[1], device=audio.device)[None, :] < lengths[:, None]).to(audio.dtype)
    n = lengths.clamp(min=1)[:, None].to(audio.dtype)
    mean = (audio * real).sum(1, keepdim=True) / n
    var = (((audio - mean) * real) ** 2).sum(1, keepdim=True) / n
    return (audio - mean) / torch.sqrt(var + 1e-7) * real


class Wav2Vec2CTC(nn.Module):
    """Raw waveforms (B, S) -> CTC log-probabilities (B, T, vocab) and frame counts: torchaudio's wav2vec 2.0,
    HuBERT or WavLM encoder, then a new linear CTC head."""

    #: the ASR task feeds this model waveforms, not log-mel features
    takes_audio = True

    def __init__(
        self,
        *,
        vocab_size: Annotated[int, Bounds(ge=1)] = 29,
        arch: Annotated[str, Bounds(choices=ARCHS)] = "wav2vec2",
        weights: str = "",
        extractor_mode: Annotated[str, Bounds(choices=EXTRACTOR_MODES)] = "group_norm",
        conv_layers: tuple[tuple[int, int, int], ...] = BASE_CONV,
        conv_bias: bool = False,
        dim: Annotated[int, Bounds(ge=1)] = 768,
        layers: Annotated[int, Bounds(ge=1)] = 12,
        heads: Annotated[int, Bounds(ge=1)] = 12,
        ff_dim: Annotated[int, Bounds(ge=1)] = 3072,
        pos_conv_kernel: Annotated[int, Bounds(ge=1)] = 128,
        pos_conv_groups: Annotated[int, Bounds(ge=1)] = 16,
        layer_norm_first: bool = False,
        num_buckets: Annotated[int, Bounds(ge=1)] = 320,
        max_distance: Annotated[int, Bounds(ge=1)] = 800,
        dropout: Annotated[float, Bounds(ge=0, lt=1)] = 0.1,
        attention_dropout: Annotated[float, Bounds(ge=0, lt=1)] = 0.1,
        activation_dropout: Annotated[float, Bounds(ge=0, lt=1)] = 0.0,
        feature_dropout: Annotated[float, Bounds(ge=0, lt=1)] = 0.0,
        layer_drop: Annotated[float, Bounds(ge=0, lt=1)] = 0.1,
        mask_time_prob: Annotated[float, Bounds(ge=0, le=1)] = 0.05,
        mask_time_length: Annotated[int, Bounds(ge=1)] = 10,
        freeze_feature_encoder: bool = True,
        freeze_encoder_steps: Annotated[int, Bounds(ge=0)] = 0,
        encoder_lr_scale: Annotated[float, Bounds(gt=0, le=1)] = 0.05,
        normalize_audio: bool = False,
    ) -> None:
        """Plain module; `wav2vec2_ctc`, `hubert_ctc` and `wavlm_ctc` register it with the base sizes.

        vocab_size: output symbols of the new CTC head, blank included (the character tokenizer has 29)
        arch: wav2vec2, hubert (the same network as wav2vec2; its files name it so) or wavlm (gated relative
            position bias in attention)
        weights: a local pretrained file: a torchaudio, fairseq or Hugging Face state dict (.pt/.pth/.bin
            read with weights_only=True, or .safetensors), or a Hugging Face model folder; nothing
            downloads. Where the file says its sizes (config.json beside it, a fairseq cfg/args), they
            replace the size arguments below (SIZE_KEYS); a bare state dict must fit them. The file's head
            is dropped; the encoder loads strictly. Empty: random init
        extractor_mode: the feature encoder's normalization: group_norm (base models) or layer_norm (large)
        conv_layers: the feature encoder's layers as [channels, kernel, stride]; the strides' product is the
            samples per output frame (320: 20 ms at 16 kHz)
        conv_bias: biases in the feature encoder's convolutions (large models)
        dim: width of the Transformer
        layers: Transformer layers
        heads: attention heads per layer
        ff_dim: hidden width of the feed-forward layers
        pos_conv_kernel: kernel of the convolutional position embedding, in frames
        pos_conv_groups: groups of that convolution
        layer_norm_first: pre-norm Transformer layers (large models) rather than post-norm
        num_buckets: wavlm: buckets of the relative position bias
        max_distance: wavlm: largest distance the relative position bias tells apart, in frames
        dropout: dropout after attention and feed-forward layers
        attention_dropout: dropout on attention weights
        activation_dropout: dropout inside the feed-forward layers
        feature_dropout: dropout on the projected features
        layer_drop: probability that a training forward skips each Transformer layer (layer drop)
        mask_time_prob: about the fraction of encoder frames replaced by the mask embedding while training,
            in spans (0: off)
        mask_time_length: frames per masked span
        freeze_feature_encoder: the convolutional feature encoder is not trained
        freeze_encoder_steps: optimizer steps during which only the head trains (the encoder stays frozen)
        encoder_lr_scale: the encoder's learning rate as a fraction of optim.lr (the head's)
        normalize_audio: each waveform at zero mean and unit variance first (what large models expect)
        """
        import torchaudio.models as tam

        if arch not in ARCHS:
            raise ConfigError(f"model.arch={arch} is unknown; valid: {', '.join(ARCHS)}")
        given = dict(
            extractor_mode=extractor_mode,
            conv_layers=tuple(tuple(int(x) for x in c) for c in conv_layers),
            conv_bias=conv_bias,
            dim=dim,
            layers=layers,
            heads=heads,
            ff_dim=ff_dim,
            pos_conv_kernel=pos_conv_kernel,
            pos_conv_groups=pos_conv_groups,
            layer_norm_first=layer_norm_first,
            num_buckets=num_buckets,
            max_distance=max_distance,
            normalize_audio=normalize_audio,
        )
        source = read_pretrained(weights, arch) if weights else None
        #: the sizes the weights file's own config set (recorded with the run: its checkpoints need them)
        self.file_sizes: dict[str, Any] = dict(source.sizes) if source else {}
        if source and source.sizes:
            changed = {k: v for k, v in source.sizes.items() if given[k] != v}
            log.info(
                "model.weights: sizes from %s%s",
                source.sizes_from,
                ": " + ", ".join(f"model.{k}={_show(v)}" for k, v in changed.items()) if changed else "",
            )
            given |= source.sizes
        extractor_mode, conv_layers = given["extractor_mode"], given["conv_layers"]
        conv_bias = given["conv_bias"]
        dim, layers, heads, ff_dim = given["dim"], given["layers"], given["heads"], given["ff_dim"]
        pos_conv_kernel, pos_conv_groups = given["pos_conv_kernel"], given["pos_conv_groups"]
        layer_norm_first, normalize_audio = given["layer_norm_first"], given["normalize_audio"]
        num_buckets, max_distance = given["num_buckets"], given["max_distance"]
        if dim % heads:
            raise ConfigError(f"model.dim={dim} must divide into model.heads={heads} heads")
        super().__init__()
        self.vocab_size, self.arch = vocab_size, arch
        self.conv_layers = tuple((int(c), int(k), int(s)) for c, k, s in conv_layers)
        self.layer_drop, self.mask_time_prob, self.mask_time_length = (
            layer_drop,
            mask_time_prob,
            mask_time_length,
        )
        self.freeze_feature_encoder, self.freeze_encoder_steps = freeze_feature_encoder, freeze_encoder_steps
        self.encoder_lr_scale, self.normalize_audio = encoder_lr_scale, normalize_audio
        self.num_updates, self._forwards = 0, 0  # optimizer steps; training forwards within this step
        #: some steps leave parameters without gradients (read by core.distributed's DDP wrapping)
        self.skips_parameters = layer_drop > 0 or freeze_encoder_steps > 0
        sizes: dict[str, Any] = dict(
            extractor_mode=extractor_mode,
            extractor_conv_layer_config=[list(c) for c in self.conv_layers],
            extractor_conv_bias=conv_bias,
            encoder_embed_dim=dim,
            encoder_projection_dropout=feature_dropout,
            encoder_pos_conv_kernel=pos_conv_kernel,
            encoder_pos_conv_groups=pos_conv_groups,
            encoder_num_layers=layers,
            encoder_num_heads=heads,
            encoder_attention_dropout=attention_dropout,
            encoder_ff_interm_features=ff_dim,
            encoder_ff_interm_dropout=activation_dropout,
            encoder_dropout=dropout,
            encoder_layer_norm_first=layer_norm_first,
            encoder_layer_drop=0.0,  # layer drop is applied here (forward), where padding is masked too
            aux_num_out=None,
        )
        if arch == "wavlm":
            net = tam.wavlm_model(**sizes, encoder_num_buckets=num_buckets, encoder_max_distance=max_distance)
        else:
            net = tam.wav2vec2_model(**sizes)
        # torchaudio's two parts, under their own names: this module's encoder keys are torchaudio's layout
        self.feature_extractor, self.encoder = net.feature_extractor, net.encoder
        # fairseq initializes the mask embedding uniformly in [0, 1); pretrained files carry their own
        self.mask_embedding = nn.Parameter(torch.rand(dim))
        self.head = nn.Linear(dim, vocab_size)
        if freeze_feature_encoder:
            self.feature_extractor.requires_grad_(False)
        if source:
            self._load_encoder(source)

    def set_num_updates(self, step: int) -> None:
        """The optimizer step the run is at (UpdateCounter calls this): the encoder trains from
        `freeze_encoder_steps` on."""
        self.num_updates, self._forwards = step, 0

    def lr_scale(self) -> dict[str, float]:
        """Parameter name -> learning-rate factor (core.optim.param_groups): the encoder at
        encoder_lr_scale, the head at the full rate."""
        return {n: self.encoder_lr_scale for n, _ in self.named_parameters() if not n.startswith("head.")}

    def out_lengths(self, samples: torch.Tensor) -> torch.Tensor:
        """Output frames of waveforms of `samples` samples (each convolution: (n - kernel) // stride + 1)."""
        for _, kernel, stride in self.conv_layers:
            samples = torch.div(samples - kernel, stride, rounding_mode="floor").add(1).clamp(min=0)
        return samples

    def min_samples(self, frames: int) -> int:
        """The fewest samples that give `frames` output frames."""
        for _, kernel, stride in reversed(self.conv_layers):
            frames = (frames - 1) * stride + kernel
        return frames

    def forward(self, audio: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) zero-padded waveforms and their sample counts -> log-probabilities (B, T, V) and frame
        counts (B,)."""
        if self.normalize_audio:
            audio = _normalized(audio, lengths)
        frozen_features = self.training and self.freeze_feature_encoder
        with torch.no_grad() if frozen_features else contextlib.nullcontext():
            x, lengths = self.feature_extractor(audio, lengths)
        frozen = self.training and self.num_updates < self.freeze_encoder_steps
        with torch.no_grad() if frozen else contextlib.nullcontext():
            x = self._encode(x, lengths)
        return self.head(x).float().log_softmax(-1), lengths

    def _encode(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """torchaudio's Encoder.forward with the padding as a key mask (its WavLM layers take it only so),
        masking and layer drop while training."""
        x = self.encoder.feature_projection(feats)
        pad = torch.arange(x.shape[1], device=x.device)[None, :] >= lengths[:, None]
        x = x.masked_fill(pad[..., None], 0.0)
        if self.training and self.mask_time_prob > 0:
            masked = time_mask(lengths, x.shape[1], self.mask_time_prob, self.mask_time_length)
            x = torch.where(masked[..., None], self.mask_embedding.to(x.dtype), x)
        t = self.encoder.transformer
        x = x + t.pos_conv_embed(x)
        if t.layer_norm_first:
            x = t.layer_norm(x)
        x = t.dropout(x)
        # wav2vec2's attention takes a (B, 1, T, T) mask; WavLM's takes key padding only (and asserts no mask)
        attn_mask = None if self.arch == "wavlm" else ~pad[:, None, None, :].expand(-1, 1, x.shape[1], -1)
        # WavLM adds its key mask to its position bias: additive, in the bias's dtype (the parameters', also
        # under autocast), not bool
        dtype = self.mask_embedding.dtype
        key_mask = torch.zeros(pad.shape, dtype=dtype, device=x.device).masked_fill(pad, float("-inf"))
        bias = None
        skip = self._dropped_layers(len(t.layers)) if self.training and self.layer_drop > 0 else set()
        for i, layer in enumerate(t.layers):
            if i not in skip:
                x, bias = layer(x, attn_mask, position_bias=bias, key_padding_mask=key_mask)
        if not t.layer_norm_first:
            x = t.layer_norm(x)
        return x

    def _dropped_layers(self, n: int) -> set[int]:
        """The layers this training forward skips: drawn from the optimizer step and the forward's index
        within it, not the global RNG, so every data-parallel rank skips the same ones (a sharded layer's
        all-gather is a collective all ranks must join) and a resumed run skips what the first one did.
        WavLM's first layer makes the position bias the later ones use (its padding mask rides on that
        bias), so it is never skipped."""
        g = torch.Generator().manual_seed(self.num_updates * 1_000_003 + self._forwards)
        self._forwards += 1
        draws = torch.rand(n, generator=g)
        first = 1 if self.arch == "wavlm" else 0
        return {i for i in range(first, n) if draws[i] < self.layer_drop}

    def load_pretrained(self, path: str) -> None:
        """The encoder (and mask embedding, when the file has one) from `path`, strictly: any tensor the file
        lacks, has extra or has in another shape is a CheckpointError naming the first ones. The head starts
        from random; the log names what was loaded, what was dropped and what is new."""
        self._load_encoder(read_pretrained(path, self.arch))

    def _load_encoder(self, source: PretrainedFile) -> None:
        """load_pretrained's strict load, of a file already read."""
        path, layout = source.path, source.layout
        encoder, mask, dropped = to_torchaudio(
            source.state, layout, self.arch, len(self.encoder.transformer.layers)
        )
        own = {k: v for k, v in self.state_dict().items() if k.startswith(("feature_extractor.", "encoder."))}
        # in the model's order, so the first named is the first layer that differs
        problems = [
            f"{k} missing from the file"
            if k not in encoder
            else f"{k} is {tuple(encoder[k].shape)} in the file, {tuple(v.shape)} here"
            for k, v in own.items()
            if k not in encoder or encoder[k].shape != v.shape
        ]
        problems += [f"{k} unknown to model.arch={self.arch}" for k in encoder if k not in own]
        if mask is not None and mask.shape != self.mask_embedding.shape:
            problems.append(
                f"mask_embedding is {tuple(mask.shape)} in the file, {tuple(self.mask_embedding.shape)}"
            )
        if problems:
            raise CheckpointError(
                f"model.weights={path} ({layout} layout) does not fit model.arch={self.arch} at these sizes: "
                f"{'; '.join(problems[:3])}{f' (+{len(problems) - 3} more)' if len(problems) > 3 else ''}; "
                "set model.dim/layers/heads/ff_dim/conv_layers/... to the file's",
                key="model.weights",
                value=str(path),
                valid=tuple(problems[:3]),
            )
        new = ["head.weight", "head.bias"] + ([] if mask is not None else ["mask_embedding"])
        full = {**encoder, "mask_embedding": self.mask_embedding.detach() if mask is None else mask}
        full |= {k: v for k, v in self.state_dict().items() if k.startswith("head.")}
        load_model_state(self, full, path)
        log.info(
            "model.weights: %d encoder tensors of model.arch=%s from %s (%s layout); new: %s (vocab %d)%s",
            len(encoder),
            self.arch,
            path,
            layout,
            ", ".join(new),
            self.vocab_size,
            f"; dropped from the file: {', '.join(dropped[:6])}{' ...' if len(dropped) > 6 else ''}"
            if dropped
            else "",
        )


@dataclass(frozen=True)
class PretrainedFile:
    """A pretrained file as read: its state dict, key layout, and the sizes its own config gives (empty when
    it has none), with where those came from."""

    path: str
    state: dict[str, torch.Tensor]
    layout: str
    sizes: dict[str, Any]
    sizes_from: str


def read_pretrained(path: str, arch: str) -> PretrainedFile:
    """`model.weights=path` read for model.arch=`arch`: a weights file, or a Hugging Face model folder
    (config.json beside model.safetensors or pytorch_model.bin). Nothing in it runs."""
    file = Path(path).expanduser()
    if file.is_dir():
        found = [file / name for name in _HF_WEIGHTS if (file / name).is_file()]
        if not found:
            raise ConfigError(
                f"model.weights={path} is a folder without {' or '.join(_HF_WEIGHTS)}; give the weights file "
                "or a Hugging Face model folder",
                key="model.weights",
                value=str(path),
                valid=_HF_WEIGHTS,
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
    return PretrainedFile(str(path), state, layout, sizes, sizes_from)


def _file_sizes(raw: Any, file: Path, path: str) -> tuple[dict[str, Any], str, str]:
    """(the sizes the file's config gives, where they are, the architecture it names: '' if unknown); all
    empty when the file has no config: a bare state dict, built to the run's model.* keys."""
    if isinstance(raw, dict) and ("cfg" in raw or "args" in raw):
        model, task = _fairseq_configs(raw)
        if model is not None:
            where = "the file's fairseq config"
            return _checked(_fairseq_sizes(model, task), path, where), where, _fairseq_arch(model)
    config = file.parent / "config.json"
    if file.suffix in (".safetensors", ".bin") and config.is_file():  # a Hugging Face model folder
        hf = _json_object(config, "model.weights", path)
        if hf.get("model_type") not in ARCHS:
            raise ConfigError(
                f"model.weights={path}: {config} is a model_type={hf.get('model_type')} model; the encoders "
                f"here are {', '.join(ARCHS)}",
                key="model.weights",
                value=str(path),
                valid=ARCHS,
            )
        pre = file.parent / "preprocessor_config.json"
        normalize = _json_object(pre, "model.weights", path).get("do_normalize") if pre.is_file() else None
        sizes = _checked(_huggingface_sizes(hf, normalize), path, str(config))
        return sizes, str(config), str(hf["model_type"])
    return {}, "", ""


def _fairseq_configs(raw: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(the model's and the task's settings, as dicts) of a fairseq checkpoint: `cfg` (fairseq >= 0.10,
    saved as plain containers; microsoft/unilm's WavLM keeps the model's settings at its top), else the older
    `args` Namespace; a fine-tuned model's own are its pretraining's, under w2v_args. None: neither."""

    def plain(x: Any) -> dict[str, Any]:
        return x if isinstance(x, dict) else dict(vars(x)) if hasattr(x, "__dict__") else {}

    cfg, args = raw.get("cfg"), raw.get("args")
    if isinstance(cfg, dict):
        model = plain(cfg.get("model")) or (cfg if "encoder_embed_dim" in cfg else {})
        task = plain(cfg.get("task"))
    else:
        model = task = plain(args)
    inner = model.get("w2v_args")
    if inner is not None:  # a fine-tuned model: its encoder's sizes are the pretrained model's
        inner = plain(inner)
        model, task = plain(inner.get("model")) or inner, plain(inner.get("task")) or inner
    return (model if "encoder_embed_dim" in model else None), task


def _fairseq_arch(model: dict[str, Any]) -> str:
    """wav2vec2, hubert or wavlm, as a fairseq config names it ('' when it does not say)."""
    if model.get("relative_position_embedding"):
        return "wavlm"
    name = str(model.get("_name", model.get("arch", "")))
    return next((a for a in ("hubert", "wav2vec2") if name.startswith(a[:7])), "")


def _fairseq_sizes(model: dict[str, Any], task: dict[str, Any]) -> dict[str, Any]:
    """The sizes in a fairseq model config (the names of fairseq's Wav2Vec2Config and HubertConfig, and of
    unilm's WavLMConfig)."""
    names = {
        "encoder_embed_dim": "dim",
        "encoder_layers": "layers",
        "encoder_attention_heads": "heads",
        "encoder_ffn_embed_dim": "ff_dim",
        "conv_bias": "conv_bias",
        "conv_pos": "pos_conv_kernel",
        "conv_pos_groups": "pos_conv_groups",
        "layer_norm_first": "layer_norm_first",
        "num_buckets": "num_buckets",
        "max_distance": "max_distance",
    }
    sizes = {ours: model[theirs] for theirs, ours in names.items() if theirs in model}
    if "extractor_mode" in model:  # fairseq's "default" is the group-norm feature encoder
        sizes["extractor_mode"] = "layer_norm" if model["extractor_mode"] == "layer_norm" else "group_norm"
    if "conv_feature_layers" in model:
        sizes["conv_layers"] = _conv_layers_literal(str(model["conv_feature_layers"]))
    if "normalize" in task:
        sizes["normalize_audio"] = task["normalize"]
    return sizes


def _conv_layers_literal(text: str) -> Any:
    """fairseq's conv_feature_layers, a Python expression of lists of (channels, kernel, stride) tuples
    joined by + and repeated by * (e.g. "[(512, 10, 5)] + [(512, 3, 2)] * 4"), evaluated without running
    it: only literals, + and * are read; anything else gives None (then refused by the checks)."""

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [value(e) for e in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(type(node).__name__)

    try:
        layers = value(ast.parse(text, mode="eval").body)
        return tuple(tuple(int(x) for x in layer) for layer in layers)
    except (SyntaxError, ValueError, TypeError):
        return None


def _huggingface_sizes(config: dict[str, Any], normalize: Any) -> dict[str, Any]:
    """The sizes in a transformers config.json (Wav2Vec2Config, HubertConfig, WavLMConfig names)."""
    names = {
        "hidden_size": "dim",
        "num_hidden_layers": "layers",
        "num_attention_heads": "heads",
        "intermediate_size": "ff_dim",
        "conv_bias": "conv_bias",
        "num_conv_pos_embeddings": "pos_conv_kernel",
        "num_conv_pos_embedding_groups": "pos_conv_groups",
        "do_stable_layer_norm": "layer_norm_first",
        "num_buckets": "num_buckets",
        "max_bucket_distance": "max_distance",
    }
    sizes = {ours: config[theirs] for theirs, ours in names.items() if theirs in config}
    if "feat_extract_norm" in config:
        sizes["extractor_mode"] = f"{config['feat_extract_norm']}_norm"
    conv = [config.get(k) for k in ("conv_dim", "conv_kernel", "conv_stride")]
    if all(isinstance(c, list) for c in conv):
        sizes["conv_layers"] = tuple(zip(*conv, strict=True)) if len({len(c) for c in conv}) == 1 else None
    if normalize is not None:
        sizes["normalize_audio"] = normalize
    return sizes


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


def _json_object(file: Path, key: str, value: str) -> dict[str, Any]:
    """The JSON object in `file` (a model folder's config, a run's saved sizes), or one CheckpointError
    naming `key=value`."""
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        data = e
    if not isinstance(data, dict):
        why = type(data).__name__ if isinstance(data, Exception) else "no JSON object"
        raise CheckpointError(
            f"{key}={value}: {file} is not a readable JSON object ({why})",
            key=key,
            value=value,
            valid=("a JSON object",),
        )
    return data


def saved_sizes(file: Path, keys: tuple[str, ...] = SIZE_KEYS) -> dict[str, Any]:
    """The sizes a run's pretrained file gave its model, as the run saved them (JSON; {} when there is no
    such file): only the model's size keys (`keys`), or one CheckpointError naming the file."""
    if not file.is_file():
        return {}
    sizes = _json_object(file, "checkpoint", str(file))
    if not set(sizes) <= set(keys):
        raise CheckpointError(
            f"{file} holds more than the pretrained model's size keys",
            key="checkpoint",
            value=str(file),
            valid=keys,
        )
    return sizes


def _show(value: Any) -> str:
    """A size as a command-line override would spell it."""
    if isinstance(value, tuple):
        return json.dumps([list(c) for c in value]).replace(" ", "")
    return str(value).lower() if isinstance(value, bool) else str(value)


def detect_layout(state: Mapping[str, torch.Tensor], path: str) -> str:
    """Which of torchaudio's, fairseq's or Hugging Face's key layouts a wav2vec2-family state dict has."""
    keys = [_strip_prefix(k) for k in state]
    if any(k.startswith(("encoder.transformer.", "encoder.feature_projection.")) for k in keys):
        return "torchaudio"
    if any(k.startswith(("post_extract_proj.", "encoder.pos_conv.")) for k in keys):
        return "fairseq"
    if any(k.startswith(("feature_projection.", "encoder.pos_conv_embed.")) for k in keys):
        return "huggingface"
    raise CheckpointError(
        f"model.weights={path} is not a wav2vec2/HuBERT/WavLM state dict in any layout known here "
        f"(first keys: {', '.join(list(state)[:3])})",
        key="model.weights",
        value=str(path),
        valid=LAYOUTS,
    )


def _strip_prefix(key: str) -> str:
    """`key` without the wrapper a fine-tuned or task model puts around the encoder: fairseq's
    w2v_encoder./w2v_model., Hugging Face's wav2vec2./hubert./wavlm."""
    for prefix in ("w2v_encoder.", "w2v_model.", "wav2vec2.", "hubert.", "wavlm."):
        key = key.removeprefix(prefix)
    return key


def _fairseq_key(key: str) -> str:
    """A fairseq (or microsoft/unilm WavLM) key in torchaudio's layout, before WavLM's q/k/v are joined."""
    from torchaudio.models.wav2vec2.utils.import_fairseq import _map_key

    # unilm's WavLM attention extras, which torchaudio's fairseq map (wav2vec2/HuBERT only) does not know
    wavlm = re.match(
        r"encoder\.layers\.(\d+)\.self_attn\.(relative_attention_bias|grep_linear|grep_a)(.*)", key
    )
    if wavlm:
        name = {"relative_attention_bias": "rel_attn_embed", "grep_linear": "gru_rel_pos_linear"}
        i, part, rest = wavlm.groups()
        return f"encoder.transformer.layers.{i}.attention.{name.get(part, 'gru_rel_pos_const')}{rest}"
    try:
        return _map_key(key) or key
    except ValueError:  # a key torchaudio's map does not know: reported as unknown by the strict check
        return key


def _huggingface_key(key: str) -> str:
    """A Hugging Face key (prefix stripped) in torchaudio's layout: the encoder's parts move under
    `encoder.`, the Transformer's under `encoder.transformer.`."""
    if key.startswith("feature_projection."):
        return f"encoder.{key}"
    if key.startswith("encoder."):
        return f"encoder.transformer.{key.removeprefix('encoder.')}"
    return key


def to_torchaudio(
    state: Mapping[str, torch.Tensor], layout: str, arch: str, layers: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, list[str]]:
    """(the encoder's tensors under torchaudio's names, the mask embedding or None, the keys dropped: heads
    and pretraining-only parts) of a state dict in `layout`."""
    from torchaudio.models.wav2vec2.utils.import_huggingface import transform_wavlm_encoder_state

    encoder: dict[str, torch.Tensor] = {}
    mask, dropped = None, []
    for raw, value in state.items():
        key = _strip_prefix(raw)
        if key in _MASK_KEYS:
            mask = value
            continue
        if _DROPPED.match(key):
            dropped.append(raw)
            continue
        if layout == "fairseq":
            key = _fairseq_key(key)
        elif layout == "huggingface":
            key = _huggingface_key(key)
        for old, new in _WEIGHT_NORM.items():  # older files keep weight norm's pre-parametrization names
            if key == f"{_POS_CONV}{old}":
                key = f"{_POS_CONV}{new}"
        encoder[key] = value
    split = "encoder.transformer.layers.0.attention.q_proj.weight"
    if (
        arch == "wavlm" and split in encoder
    ):  # fairseq's and HF's WavLM keep q/k/v apart, torchaudio joins them
        prefix = "encoder.transformer."
        inner = {k.removeprefix(prefix): v for k, v in encoder.items() if k.startswith(prefix)}
        # fewer layers in the file than here: the strict check below names what is missing
        with contextlib.suppress(KeyError):
            transform_wavlm_encoder_state(inner, layers)
        encoder = {k: v for k, v in encoder.items() if not k.startswith(prefix)}
        encoder |= {prefix + k: v for k, v in inner.items()}
    return encoder, mask, dropped


_SHARED = {"vocab_size": 29}
for _name, _arch in (("wav2vec2_ctc", "wav2vec2"), ("hubert_ctc", "hubert"), ("wavlm_ctc", "wavlm")):
    MODELS.register_preset(
        _name,
        Wav2Vec2CTC,
        f"{_arch} encoder (torchaudio's, base sizes by default; model.weights=PATH: a pretrained file) and a "
        "new CTC head, on raw audio.",
        arch=_arch,
        **_SHARED,
    )
