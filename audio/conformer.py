"""Conformer-CTC (Gulati et al., 2020): convolutional subsampling, Conformer blocks, a character CTC head.

Self-attention goes through `core.attention.attention` with a key padding mask; positions are encoded with
rotary embeddings on queries and keys, which keeps attention relative (as the paper's relative encoding does)
while staying a plain dense (B, H, L, D) call.
"""

from __future__ import annotations

from typing import Annotated

import torch
import torch.nn.functional as F
from torch import nn

from audio.asr_model import ASRModel
from core.attention import attention
from core.bounds import Bounds
from core.errors import ConfigError
from core.nn.decoder import TransformerDecoder
from core.nn.layers import apply_rope, rope_angles, rope_frequencies
from core.registry import MODELS


def rotary_tables(
    length: int, dim: int, device: torch.device, base: float = 10_000.0
) -> tuple[torch.Tensor, ...]:
    """cos/sin tables (L, dim/2) of rotary position embeddings."""
    freqs = rope_frequencies(dim, base, device=device)
    return rope_angles(freqs, torch.arange(length, device=device, dtype=torch.float32))


def _time_mask(length: int, lengths: torch.Tensor) -> torch.Tensor:
    """(B, length) mask, True on the first `lengths[b]` frames."""
    return torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]


class ConvSubsampling(nn.Module):
    """Two stride-2 3x3 convs over (time, mel) and a projection to `dim`: `factor` (4 or 2) x fewer frames.

    The second convolution is depthwise-separable (depthwise 3x3 + pointwise 1x1), about 9x cheaper than a
    full 3x3 at equal width; the full one dominated the step time of small models on CPU. With `factor=2` it
    strides over mel bins only.
    """

    def __init__(self, n_mels: int, dim: int, channels: int, factor: int = 4) -> None:
        """`channels` trades front-end cost for capacity."""
        super().__init__()
        self.factor = factor
        self.conv1 = nn.Conv2d(1, channels, 3, stride=2, padding=1)
        self.conv2 = nn.Sequential(
            nn.Conv2d(channels, channels, 3, stride=(factor // 2, 2), padding=1, groups=channels),
            nn.Conv2d(channels, channels, 1),
            nn.SiLU(),
        )
        self.proj = nn.Linear(channels * ((n_mels + 3) // 4), dim)

    def out_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """Frames after subsampling: each stride-2 conv maps n to (n - 1) // 2 + 1."""
        half = (lengths - 1) // 2 + 1
        return (half - 1) // 2 + 1 if self.factor == 4 else half

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, F) -> (B, T/factor, dim) and the new lengths."""
        x = x * _time_mask(x.shape[1], lengths)[:, :, None]
        x = F.silu(self.conv1(x[:, None]))  # (B, C, T/2, F/2)
        # zero the padding again: silu(bias) there would reach the last real frames through the next conv
        x = self.conv2(x * _time_mask(x.shape[2], (lengths - 1) // 2 + 1)[:, None, :, None])
        b, c, t, f = x.shape
        return self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f)), self.out_lengths(lengths)


class FeedForward(nn.Module):
    """Pre-norm Swish feed-forward module (used twice per block with half-step residuals)."""

    def __init__(self, dim: int, mult: int, dropout: float) -> None:
        """Expand by `mult`."""
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(dim),
            nn.Linear(dim, dim * mult),
            nn.SiLU(),
            nn.Dropout(dropout),
            nn.Linear(dim * mult, dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual branch output."""
        return self.net(x)


class SelfAttention(nn.Module):
    """Pre-norm multi-head self-attention with rotary positions and a key padding mask."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        """`dim` must divide by `heads`."""
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """`mask` is (B, L), True on real frames."""
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, *rope).to(v.dtype), apply_rope(k, *rope).to(v.dtype)
        y = attention(q, k, v, key_padding_mask=mask)
        return self.dropout(self.out(y.transpose(1, 2).reshape(b, n, d)))


class ConvModule(nn.Module):
    """Pointwise conv + GLU, depthwise conv, norm, Swish, pointwise conv.

    LayerNorm replaces the paper's BatchNorm so that padding frames never enter the statistics: an utterance
    gets the same output alone or in a padded batch.
    """

    def __init__(self, dim: int, kernel: int, dropout: float) -> None:
        """`kernel` is odd so the depthwise conv is centred."""
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.pw1 = nn.Linear(dim, 2 * dim)
        self.dw = nn.Conv1d(dim, dim, kernel, padding=kernel // 2, groups=dim)
        self.norm2 = nn.LayerNorm(dim)
        self.pw2 = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Padding frames are zeroed before the depthwise conv so they never leak into real ones."""
        y = F.glu(self.pw1(self.norm(x)), dim=-1) * mask[..., None]
        y = self.dw(y.transpose(1, 2)).transpose(1, 2)
        return self.dropout(self.pw2(F.silu(self.norm2(y))))


class ConformerBlock(nn.Module):
    """FF/2 -> self-attention -> convolution -> FF/2 -> LayerNorm (the macaron block)."""

    def __init__(self, dim: int, heads: int, ff_mult: int, kernel: int, dropout: float) -> None:
        """One Conformer block."""
        super().__init__()
        self.ff1 = FeedForward(dim, ff_mult, dropout)
        self.attn = SelfAttention(dim, heads, dropout)
        self.conv = ConvModule(dim, kernel, dropout)
        self.ff2 = FeedForward(dim, ff_mult, dropout)
        self.norm = nn.LayerNorm(dim)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """(B, L, dim) -> (B, L, dim)."""
        x = x + 0.5 * self.ff1(x)
        x = x + self.attn(x, mask, rope)
        x = x + self.conv(x, mask)
        x = x + 0.5 * self.ff2(x)
        return self.norm(x)


class ConformerCTC(ASRModel):
    """Log-mel features (B, T, n_mels) -> CTC log-probabilities (B, T/4, vocab) and their lengths; with
    `attention_decoder_layers`, a joint attention decoder beside the CTC head."""

    def __init__(
        self,
        *,
        n_mels: Annotated[int, Bounds(ge=1)],
        vocab_size: Annotated[int, Bounds(ge=1)],
        dim: Annotated[int, Bounds(ge=1)],
        layers: Annotated[int, Bounds(ge=1)],
        heads: Annotated[int, Bounds(ge=1)],
        ff_mult: Annotated[int, Bounds(ge=1)],
        kernel: Annotated[int, Bounds(ge=1)],
        subsampling_channels: Annotated[int, Bounds(ge=1)],
        subsampling: Annotated[int, Bounds(choices=(2, 4))],
        dropout: Annotated[float, Bounds(ge=0, lt=1)],
        attention_decoder_layers: Annotated[int, Bounds(ge=0)] = 0,
    ) -> None:
        """Plain module; `conformer_ctc_xs|s|m` register its sizes.

        n_mels: log-mel bins per input frame
        vocab_size: output symbols including the CTC blank (the character tokenizer has 29)
        dim: width of the blocks
        layers: Conformer blocks
        heads: attention heads per block (dim / heads must be even)
        ff_mult: hidden width of the feed-forward modules, as a multiple of dim
        kernel: depthwise convolution kernel size, in frames
        subsampling_channels: channels of the convolutional subsampling front end
        subsampling: time reduction of the front end: 2 (20 ms frames) or 4 (40 ms frames)
        dropout: dropout probability in the blocks
        attention_decoder_layers: Transformer decoder layers over the encoder's output beside the CTC head
            (joint CTC/attention, ESPnet/NeMo hybrid; as wide as the encoder, same heads; 0: CTC alone). Its
            vocabulary is the CTC one, id 0 (the blank, never a label) doubling as <sos>/<eos>
        """
        if dim % heads or (dim // heads) % 2:
            raise ConfigError(
                f"model.dim={dim} must split into model.heads={heads} even-sized heads",
                key="model.heads",
                value=str(heads),
                valid=tuple(str(h) for h in range(1, dim + 1) if dim % h == 0 and (dim // h) % 2 == 0),
            )
        if subsampling not in (2, 4):
            raise ConfigError(f"model.subsampling={subsampling} is unsupported; valid: 2, 4")
        super().__init__()
        self.n_mels, self.vocab_size, self.heads = n_mels, vocab_size, heads
        self.subsample = ConvSubsampling(n_mels, dim, subsampling_channels, subsampling)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            ConformerBlock(dim, heads, ff_mult, kernel, dropout) for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab_size)
        # absent at 0 layers, so a CTC model's state dict (and checkpoint) is what it was before the option
        self.attention_decoder = None
        if attention_decoder_layers:
            self.attention_decoder = TransformerDecoder(
                vocab_size, dim, heads, attention_decoder_layers, mlp_ratio=ff_mult, dropout=dropout
            )

    def out_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """Output frames of inputs of `lengths` feature frames."""
        return self.subsample.out_lengths(lengths)

    def encode(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder's output (B, T', dim) per subsampled frame, and the frame counts."""
        x, lengths = self.subsample(feats, lengths)
        x = self.dropout(x)
        mask = _time_mask(x.shape[1], lengths)
        rope = rotary_tables(x.shape[1], x.shape[-1] // self.heads, x.device)
        for block in self.blocks:
            x = block(x, mask, rope)
        return x, lengths

    def ctc_log_probs(self, encoded: torch.Tensor) -> torch.Tensor:
        """The CTC head's log-probabilities (fp32) of the encoder's output."""
        return self.head(encoded).float().log_softmax(-1)

    def forward(
        self, inputs: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """CTC log-probabilities over the vocabulary per subsampled frame of features `inputs`, and the
        frame counts; given `tokens` (B, L) (<sos> then the labels), the decoder's logits (B, L, V) third."""
        x, lengths = self.encode(inputs, lengths)
        log_probs = self.ctc_log_probs(x)
        if tokens is None:
            return log_probs, lengths
        if self.attention_decoder is None:
            raise ValueError("decoder inputs given, but model.attention_decoder_layers=0 (no decoder)")
        return log_probs, lengths, self.attention_decoder(tokens, x, lengths)


#: name -> (docstring, sizes) of the registered Conformer-CTC family; every other setting is shared
SIZES = {
    "conformer_ctc_xs": (
        "Conformer-CTC XS (~1.0M parameters, 20 ms frames): the embedded-corpus recipe's default on CPU.\n\n"
        "Short commands are spoken at ~15 characters/s, which leaves 40 ms frames only ~1.7 frames per "
        "character for CTC; 2x subsampling learned faster per step on the embedded corpus than 4x at a "
        "similar step cost.",
        {"dim": 96, "layers": 4, "kernel": 15, "subsampling_channels": 64, "subsampling": 2},
    ),
    "conformer_ctc_s": (
        "Conformer-CTC S (~8M parameters): the paper's S shape, 16 blocks of width 144.",
        {"dim": 144, "layers": 16, "kernel": 31, "subsampling_channels": 144, "subsampling": 4},
    ),
    "conformer_ctc_m": (
        "Conformer-CTC M (~26M parameters): the paper's M shape, 16 blocks of width 256.",
        {"dim": 256, "layers": 16, "kernel": 31, "subsampling_channels": 256, "subsampling": 4},
    ),
}
for _name, (_doc, _sizes) in SIZES.items():
    MODELS.register_preset(
        _name, ConformerCTC, _doc, n_mels=80, vocab_size=29, heads=4, ff_mult=4, dropout=0.1, **_sizes
    )
