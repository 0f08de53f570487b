"""Waveform augmentation for speech: speed perturbation (per clip, on the CPU as it is read), additive noise
and reverberation (per batch, on the training device before features).

Nothing is downloaded: the noise (white or pink) and the room impulse responses (exponentially decaying
Gaussian noise) are synthesised from torch's random generator, so a seeded run draws the same ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torchaudio.functional as AF
from torch import nn

#: amplitude falls by 60 dB over RT60: exp(-DECAY * t / rt60) with DECAY = 3 ln 10
DECAY = 3 * math.log(10)


def speed_rates(factor: float) -> tuple[int, int]:
    """(source, target) resampling rates, in lowest terms, that play audio `factor` times faster.

    The factor is rounded to 0.01, so the ratio is at most 200:100: a factor such as 0.9123 would otherwise
    give a ratio like 9123:10000 and a resampling kernel thousands of taps wide."""
    source = round(factor * 100)
    g = math.gcd(source, 100)
    return source // g, 100 // g


def speed_perturb(wav: torch.Tensor, factor: float) -> torch.Tensor:
    """`wav` (..., S) played `factor` times faster: about S / factor samples, pitch moving with the tempo
    (resampling, as Kaldi's and torchaudio's speed perturbation do)."""
    source, target = speed_rates(factor)
    if source == target:
        return wav
    return AF.resample(wav, source, target)


def _valid(lengths: torch.Tensor, size: int) -> torch.Tensor:
    """(B, size) mask of the samples within each length."""
    return torch.arange(size, device=lengths.device)[None, :] < lengths[:, None]


def _uniform(n: int, bounds: Sequence[float], device: torch.device) -> torch.Tensor:
    lo, hi = bounds
    return lo + (hi - lo) * torch.rand(n, device=device)


def coloured_noise(batch: int, size: int, pink: torch.Tensor) -> torch.Tensor:
    """(batch, size) Gaussian noise: white, or pink (power falling as 1/f) where `pink` (batch,) is true."""
    white = torch.randn(batch, size, device=pink.device)
    spectrum = torch.fft.rfft(white)
    f = torch.arange(spectrum.shape[-1], device=pink.device).clamp(min=1)
    shaped = torch.fft.irfft(spectrum / f.sqrt(), n=size)
    return torch.where(pink[:, None], shaped, white)


class _SomeUtterances(nn.Module):
    """Applies `corrupt` to a fraction `prob` of a batch's utterances: drawn first, one per utterance, then
    `corrupt`'s own draws; `prob=0` returns the batch untouched and draws nothing."""

    prob: float

    def corrupt(self, audio: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The corrupted float copy of every utterance in padded waveforms (B, S); padding zero."""
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, audio: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Padded waveforms (B, S), the chosen ones corrupted, same shape; padding stays zero."""
        if self.prob <= 0:
            return audio
        chosen = torch.rand(audio.shape[0], device=audio.device) < self.prob
        return torch.where(chosen[:, None], self.corrupt(audio, lengths).to(audio.dtype), audio)


class AddNoise(_SomeUtterances):
    """Adds white or pink noise (half each) to a fraction `prob` of the utterances, at a signal-to-noise
    ratio drawn uniformly from `snr` dB over each utterance's own samples (torchaudio's `add_noise`)."""

    def __init__(self, prob: float = 0.0, snr: Sequence[float] = (5.0, 20.0)) -> None:
        """`prob=0` disables it (and draws no random numbers)."""
        super().__init__()
        self.prob, self.snr = prob, tuple(snr)

    def corrupt(self, audio: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Noisy float copy of padded waveforms (B, S); padding stays zero."""
        b, s = audio.shape
        snr = _uniform(b, self.snr, audio.device)
        pink = torch.rand(b, device=audio.device) < 0.5
        valid = _valid(lengths, s)
        noise = coloured_noise(b, s, pink) * valid  # zero padding: features must not depend on the batch
        return AF.add_noise(audio.float(), noise, snr, lengths)


class Reverb(_SomeUtterances):
    """Convolves a fraction `prob` of the utterances with a synthetic room impulse response: Gaussian noise
    whose amplitude decays by 60 dB over an RT60 drawn uniformly from `rt60` seconds, scaled to unit energy
    (the level barely changes). The reverberant tail past an utterance's end is cut: lengths are kept."""

    def __init__(self, prob: float = 0.0, rt60: Sequence[float] = (0.2, 0.6), sample_rate: int = 16_000):
        """`prob=0` disables it (and draws no random numbers)."""
        super().__init__()
        self.prob, self.rt60, self.sample_rate = prob, tuple(rt60), sample_rate

    def impulse_responses(self, rt60: torch.Tensor) -> torch.Tensor:
        """(B, K) unit-energy impulse responses for RT60s (B,) in seconds; K spans the longest RT60 allowed,
        so every response has decayed by 60 dB before it is cut."""
        k = max(1, math.ceil(max(self.rt60) * self.sample_rate))
        t = torch.arange(k, device=rt60.device) / self.sample_rate
        envelope = torch.exp(-DECAY * t[None, :] / rt60[:, None])
        ir = torch.randn(rt60.shape[0], k, device=rt60.device) * envelope
        return ir / ir.norm(dim=-1, keepdim=True)

    def corrupt(self, audio: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Reverberant float copy of padded waveforms (B, S), same shape; padding stays zero."""
        b, s = audio.shape
        ir = self.impulse_responses(_uniform(b, self.rt60, audio.device))
        return AF.fftconvolve(audio.float(), ir)[:, :s] * _valid(lengths, s)
