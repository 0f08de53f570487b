"""audio/augment.py: speed perturbation, additive noise and synthetic reverberation, measured on outputs."""

from __future__ import annotations

import math

import pytest
import torch

from audio.augment import AddNoise, Reverb, coloured_noise, speed_perturb

RATE = 16_000


def _speech_like(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-padded (B, max length) waveforms: a few harmonics under a slow envelope, lengths as given."""
    g = torch.Generator().manual_seed(seed)
    audio = torch.zeros(len(lengths), max(lengths))
    for i, n in enumerate(lengths):
        t = torch.arange(n) / RATE
        f0 = 100 + 100 * torch.rand((), generator=g)
        tone = sum(torch.sin(2 * math.pi * k * f0 * t) / k for k in (1, 2, 3))
        audio[i, :n] = 0.1 * tone * (1.2 + torch.sin(2 * math.pi * 3 * t))
    return audio, torch.tensor(lengths)


def _snr_db(clean: torch.Tensor, noisy: torch.Tensor) -> float:
    """10 log10(P_signal / P_noise) over the samples given."""
    return float(10 * torch.log10(clean.pow(2).sum() / (noisy - clean).pow(2).sum()))


@pytest.mark.parametrize("snr", [0.0, 10.0, 25.0])
def test_noise_is_added_at_the_requested_snr_and_padding_stays_silent(snr: float) -> None:
    audio, lengths = _speech_like([16_000, 12_000, 8_000, 4_000, 16_000, 9_000, 7_000, 5_000])
    torch.manual_seed(0)
    noisy = AddNoise(prob=1.0, snr=(snr, snr))(audio, lengths)
    assert noisy.shape == audio.shape
    for i, n in enumerate(lengths.tolist()):
        # measured on each utterance's own samples; tolerance 0.5 dB (the issue's), float32 sums
        assert abs(_snr_db(audio[i, :n], noisy[i, :n]) - snr) < 0.5
        assert not noisy[i, n:].any()


def test_noise_snr_is_drawn_within_its_range_and_prob_picks_a_fraction() -> None:
    audio, lengths = _speech_like([8_000] * 64)
    torch.manual_seed(0)
    noisy = AddNoise(prob=0.5, snr=(5.0, 20.0))(audio, lengths)
    changed = [i for i in range(64) if not torch.equal(noisy[i], audio[i])]
    assert 16 <= len(changed) <= 48  # Binomial(64, 0.5): outside this range with probability < 1e-4
    snrs = [_snr_db(audio[i], noisy[i]) for i in changed]
    assert all(4.5 < s < 20.5 for s in snrs) and max(snrs) - min(snrs) > 5


def test_pink_noise_has_its_power_at_low_frequencies() -> None:
    torch.manual_seed(0)
    noise = coloured_noise(2, 32_000, torch.tensor([False, True]))
    power = torch.fft.rfft(noise).abs().pow(2)
    # power per band an octave apart: flat for white noise, halving per octave (-3 dB) for pink
    low, high = power[:, 1000:2000].mean(-1), power[:, 2000:4000].mean(-1)
    ratio = (low / high).tolist()
    assert 0.9 < ratio[0] < 1.1 and 1.8 < ratio[1] < 2.2


def _rt60_of(response: torch.Tensor) -> float:
    """RT60 from Schroeder's backward-integrated energy decay, fitted between -5 and -25 dB (T20 x 3, as
    ISO 3382 measures rooms)."""
    energy = response.pow(2).flip(0).cumsum(0).flip(0)
    decay = 10 * torch.log10(energy / energy[0])
    t = torch.arange(len(decay)) / RATE
    fit = (decay <= -5) & (decay >= -25)
    design = torch.stack([t[fit], torch.ones_like(t[fit])], 1)
    slope = torch.linalg.lstsq(design, decay[fit, None]).solution[0]
    return float(-60 / slope)


@pytest.mark.parametrize("rt60", [0.2, 0.5, 1.0])
def test_reverb_keeps_lengths_and_decays_at_the_rt60(rt60: float) -> None:
    impulse = torch.zeros(1, 2 * RATE)
    impulse[0, 100] = 1.0  # the output is the room's impulse response, delayed
    torch.manual_seed(0)
    out = Reverb(prob=1.0, rt60=(rt60, rt60), sample_rate=RATE)(impulse, torch.tensor([2 * RATE]))
    assert out.shape == impulse.shape and out[0, :100].abs().max() < 1e-6  # causal (FFT round-off aside)
    # one noise realisation: within 10% of the requested decay
    assert _rt60_of(out[0, 100:]) == pytest.approx(rt60, rel=0.1)

    audio, lengths = _speech_like([16_000, 6_000])
    torch.manual_seed(0)
    wet = Reverb(prob=1.0, rt60=(rt60, rt60), sample_rate=RATE)(audio, lengths)
    assert wet.shape == audio.shape and not wet[1, 6_000:].any()  # the tail past the end is cut
    # unit-energy responses: the level changes by a few dB at most
    ratio = wet[0].pow(2).sum() / audio[0].pow(2).sum()
    assert 0.3 < float(ratio) < 3


@pytest.mark.parametrize("factor", [0.8, 0.9, 1.1, 1.25])
def test_speed_perturbation_changes_length_by_the_factor_and_pitch_with_it(factor: float) -> None:
    n = 16_000
    tone = torch.sin(2 * math.pi * 440 * torch.arange(n) / RATE)
    out = speed_perturb(tone, factor)
    assert abs(len(out) - n / factor) <= 1
    # played faster, a 440 Hz tone comes out at 440 x factor Hz (0.25 Hz bins over 4 s of padding)
    spectrum = torch.fft.rfft(out, n=4 * RATE).abs()
    assert float(spectrum.argmax()) / 4 == pytest.approx(440 * factor, abs=1)
    assert torch.equal(speed_perturb(tone, 1.0), tone)


def test_augmentations_are_deterministic_under_a_seed_and_draw_nothing_when_off() -> None:
    audio, lengths = _speech_like([16_000, 12_000, 8_000, 4_000])

    def run(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return AddNoise(0.5, (0, 10))(Reverb(0.5, (0.2, 0.6), RATE)(audio, lengths), lengths)

    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    assert AddNoise(0.0)(audio, lengths) is audio and Reverb(0.0)(audio, lengths) is audio
    assert torch.equal(torch.rand(4), expected)  # off, they leave the generator where it was
