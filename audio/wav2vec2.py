"""Pretrained speech encoders (wav2vec 2.0, HuBERT, WavLM) fine-tuned with a new CTC head, on raw audio.

The encoder is torchaudio's (`torchaudio.models.wav2vec2_model` / `wavlm_model`, the builders of its
pretrained bundles), so a published checkpoint of any of the three loads into it: `model.weights=PATH` reads a
torchaudio, fairseq or Hugging Face state dict (`weights_only=True` or safetensors: nothing in the file runs)
and renames its keys to torchaudio's with torchaudio's own fairseq key map. The file's own output head (a
pretraining projection or another vocabulary's CTC layer) is dropped: the head here is new, sized for the
task's tokenizer.

Fine-tuning follows fairseq's and Hugging Face's wav2vec 2.0 recipes: the convolutional feature encoder
frozen, the Transformer frozen for the first `freeze_encoder_steps` updates (fairseq's
freeze_finetune_updates), time spans of the encoder's input replaced by the learned mask embedding while
training (mask_time_prob), whole Transformer layers skipped at random (layer drop), and a learning rate for
the encoder that is a fraction of the head's (`lr_scale()`, read by core.optim).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Mapping
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn

from core.bounds import Bounds
from core.callbacks import Callback
from core.checkpoint import load_model_state, read_weights
from core.errors import CheckpointError, ConfigError
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
        weights: a local pretrained file for these sizes: a torchaudio, fairseq or Hugging Face state dict
            (.pt/.pth/.bin read with weights_only=True, or .safetensors); nothing downloads. The file's head
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

        if dim % heads:
            raise ConfigError(f"model.dim={dim} must divide into model.heads={heads} heads")
        if arch not in ARCHS:
            raise ConfigError(f"model.arch={arch} is unknown; valid: {', '.join(ARCHS)}")
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
        if weights:
            self.load_pretrained(weights)

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
        state = read_weights(path, "model.weights")
        layout = detect_layout(state, path)
        encoder, mask, dropped = to_torchaudio(state, layout, self.arch, len(self.encoder.transformer.layers))
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
