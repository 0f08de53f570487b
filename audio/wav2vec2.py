"""Pretrained speech encoders (wav2vec 2.0, HuBERT, WavLM) fine-tuned with a new CTC head, on raw audio.

The encoder is torchaudio's (`torchaudio.models.wav2vec2_model` / `wavlm_model`, the builders of its
pretrained bundles), so a published checkpoint of any of the three loads into it. This module builds the
plain network from its sizes; `model.weights=PATH` is read and loaded afterwards by
`audio.checkpoints.encoder_files` (the registered builders in `audio.pretrained` chain the two): the file's
own output head is dropped, the head here is new, sized for the task's tokenizer, and where the file says its
own sizes the network is built to them, so `model=wav2vec2_ctc model.weights=PATH` loads a base or a large
model alike.

Fine-tuning follows fairseq's and Hugging Face's wav2vec 2.0 recipes: the convolutional feature encoder
frozen, the Transformer frozen for the first `freeze_encoder_steps` updates (fairseq's
freeze_finetune_updates), time spans of the encoder's input replaced by the learned mask embedding while
training (mask_time_prob), whole Transformer layers skipped at random (layer drop), and a learning rate for
the encoder that is a fraction of the head's (`lr_scale()`, read by core.optim).
"""

from __future__ import annotations

import contextlib
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn

from audio.asr_model import ASRModel
from core.bounds import Bounds
from core.errors import ConfigError
from core.loop.callbacks import Callback

ARCHS = ("wav2vec2", "hubert", "wavlm")
EXTRACTOR_MODES = ("group_norm", "layer_norm")
#: the base models' feature encoder, (channels, kernel, stride) per layer: 20 ms frames at 16 kHz
BASE_CONV = ((512, 10, 5),) + ((512, 3, 2),) * 4 + ((512, 2, 2),) * 2
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


#: our keywords -> torchaudio's `wav2vec2_model` / `wavlm_model` ones (the last two, the relative position
#: bias, only wavlm takes)
_TORCHAUDIO_KEYS = {
    "extractor_mode": "extractor_mode",
    "conv_layers": "extractor_conv_layer_config",
    "conv_bias": "extractor_conv_bias",
    "dim": "encoder_embed_dim",
    "feature_dropout": "encoder_projection_dropout",
    "pos_conv_kernel": "encoder_pos_conv_kernel",
    "pos_conv_groups": "encoder_pos_conv_groups",
    "layers": "encoder_num_layers",
    "heads": "encoder_num_heads",
    "attention_dropout": "encoder_attention_dropout",
    "ff_dim": "encoder_ff_interm_features",
    "activation_dropout": "encoder_ff_interm_dropout",
    "dropout": "encoder_dropout",
    "layer_norm_first": "encoder_layer_norm_first",
    "num_buckets": "encoder_num_buckets",
    "max_distance": "encoder_max_distance",
}
_WAVLM_ONLY = ("num_buckets", "max_distance")


def _check_sizes(arch: str, dim: int, heads: int) -> None:
    """The ConfigError for an unknown architecture or a width the heads do not divide."""
    if arch not in ARCHS:
        raise ConfigError(f"model.arch={arch} is unknown; valid: {', '.join(ARCHS)}")
    if dim % heads:
        raise ConfigError(f"model.dim={dim} must divide into model.heads={heads} heads")


def _torchaudio_network(settings: dict[str, Any]) -> nn.Module:
    """torchaudio's wav2vec 2.0 (HuBERT's too) or WavLM network, built from `Wav2Vec2CTC`'s keywords."""
    import torchaudio.models as tam

    wavlm = settings["arch"] == "wavlm"
    sizes: dict[str, Any] = {
        theirs: settings[ours]
        for ours, theirs in _TORCHAUDIO_KEYS.items()
        if wavlm or ours not in _WAVLM_ONLY
    }
    sizes["extractor_conv_layer_config"] = [list(c) for c in settings["conv_layers"]]
    # layer drop is applied here (forward), where padding is masked too
    sizes.update(encoder_layer_drop=0.0, aux_num_out=None)
    return tam.wavlm_model(**sizes) if wavlm else tam.wav2vec2_model(**sizes)


class Wav2Vec2CTC(ASRModel):
    """Raw waveforms (B, S) -> CTC log-probabilities (B, T, vocab) and frame counts: torchaudio's wav2vec 2.0,
    HuBERT or WavLM encoder, then a new linear CTC head."""

    takes_audio = True
    size_keys = SIZE_KEYS

    def __init__(
        self,
        *,
        vocab_size: Annotated[int, Bounds(ge=1)] = 29,
        arch: Annotated[str, Bounds(choices=ARCHS)] = "wav2vec2",
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
        given = locals()  # the keywords as given, before any other local: the network's go to torchaudio
        _check_sizes(arch, dim, heads)
        super().__init__()
        self.vocab_size, self.arch, self.layer_drop = vocab_size, arch, layer_drop
        self.conv_layers = tuple((int(c), int(k), int(s)) for c, k, s in conv_layers)
        self.mask_time_prob, self.mask_time_length = mask_time_prob, mask_time_length
        self.freeze_feature_encoder, self.freeze_encoder_steps = freeze_feature_encoder, freeze_encoder_steps
        self.encoder_lr_scale, self.normalize_audio = encoder_lr_scale, normalize_audio
        self.num_updates, self._forwards = 0, 0  # optimizer steps; training forwards within this step
        #: some steps leave parameters without gradients (read by core.distributed's DDP wrapping)
        self.skips_parameters = layer_drop > 0 or freeze_encoder_steps > 0
        net = _torchaudio_network({**given, "conv_layers": self.conv_layers})
        # torchaudio's two parts, under their own names: this module's encoder keys are torchaudio's layout
        self.feature_extractor, self.encoder = net.feature_extractor, net.encoder
        # fairseq initializes the mask embedding uniformly in [0, 1); pretrained files carry their own
        self.mask_embedding = nn.Parameter(torch.rand(dim))
        self.head = nn.Linear(dim, vocab_size)
        if freeze_feature_encoder:
            self.feature_extractor.requires_grad_(False)

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

    def forward(
        self, inputs: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) zero-padded waveforms `inputs` and their sample counts -> log-probabilities (B, T, V) and
        frame counts (B,). No attention decoder: `tokens` must be None."""
        if tokens is not None:
            raise ValueError("decoder inputs given, but a wav2vec2-family model has no attention decoder")
        audio = inputs
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
