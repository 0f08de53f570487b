"""Log-mel features and SpecAugment, computed on the training device from padded waveforms."""

from __future__ import annotations

import torch
import torchaudio
from torch import nn


class LogMel(nn.Module):
    """Padded waveforms (B, S) -> per-utterance normalised log-mel features (B, T, n_mels) and lengths."""

    def __init__(
        self, sample_rate: int = 16_000, n_mels: int = 80, win_ms: float = 25.0, hop_ms: float = 10.0
    ):
        """25 ms Hann windows every 10 ms, as in most ASR front ends."""
        super().__init__()
        self.hop = int(sample_rate * hop_ms / 1000)
        win = int(sample_rate * win_ms / 1000)
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=sample_rate,
            n_fft=512,
            win_length=win,
            hop_length=self.hop,
            n_mels=n_mels,
            pad_mode="constant",  # zeros, like batch padding; reflection made the end frames batch-dependent
        )

    def frames(self, lengths: torch.Tensor) -> torch.Tensor:
        """Number of feature frames of waveforms of `lengths` samples (centred STFT)."""
        return lengths // self.hop + 1

    @torch.no_grad()
    def forward(self, audio: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Features (B, T, n_mels), zero beyond each length, and their lengths."""
        feats = torch.log(self.mel(audio.float()) + 1e-6)  # (B, n_mels, T)
        n = self.frames(lengths)
        valid = torch.arange(feats.shape[-1], device=feats.device)[None, :] < n[:, None]  # (B, T)
        mask = valid[:, None, :].to(feats.dtype)
        # Statistics over valid frames only, so padding never changes an utterance's features.
        count = n[:, None, None].to(feats.dtype)
        mean = (feats * mask).sum(-1, keepdim=True) / count
        var = (((feats - mean) * mask) ** 2).sum(-1, keepdim=True) / count
        feats = (feats - mean) / (var + 1e-5).sqrt() * mask
        return feats.transpose(1, 2).contiguous(), n


class SpecAugment(nn.Module):
    """Frequency and time masking (Park et al., 2019) through torchaudio, independent per utterance."""

    def __init__(self, freq_masks: int = 2, freq_width: int = 15, time_masks: int = 2, time_width: int = 25):
        """`freq_width`/`time_width` are the largest mask widths in bins/frames."""
        super().__init__()
        self.freq = nn.ModuleList(
            torchaudio.transforms.FrequencyMasking(freq_width, iid_masks=True) for _ in range(freq_masks)
        )
        self.time = nn.ModuleList(
            torchaudio.transforms.TimeMasking(time_width, iid_masks=True) for _ in range(time_masks)
        )

    @torch.no_grad()
    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """Masked copy of (B, T, F) features (masked values are 0, the normalised mean)."""
        x = feats.transpose(1, 2)[:, None]  # torchaudio wants (B, C, F, T) for per-example masks
        for m in [*self.freq, *self.time]:
            x = m(x)
        return x[:, 0].transpose(1, 2).contiguous()


class FrequencyWarp(nn.Module):
    """Random per-utterance stretch of the mel axis by a factor in [1 - max_warp, 1 + max_warp].

    eSpeak NG voice variants differ mostly in formant scaling, so stretching the spectrum (as vocal tract
    length perturbation does) lets training voices stand in for unheard ones.
    """

    def __init__(self, max_warp: float = 0.1) -> None:
        """`max_warp=0` disables it."""
        super().__init__()
        self.max_warp = max_warp

    @torch.no_grad()
    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """Warped copy of (B, T, F) features (linear interpolation between bins, edge bins repeated)."""
        if self.max_warp <= 0:
            return feats
        b, _, f = feats.shape
        alpha = 1 + (torch.rand(b, 1, device=feats.device) * 2 - 1) * self.max_warp
        pos = (torch.arange(f, device=feats.device, dtype=feats.dtype)[None, :] * alpha).clamp(max=f - 1)
        lo = pos.floor().long()
        hi = (lo + 1).clamp(max=f - 1)
        w = (pos - lo)[:, None, :]
        take = lambda idx: feats.gather(2, idx[:, None, :].expand(-1, feats.shape[1], -1))
        return take(lo) * (1 - w) + take(hi) * w
