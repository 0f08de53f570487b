"""Log-mel features are padding-invariant; SpecAugment masks each utterance independently."""

from __future__ import annotations

import torch

from audio.features import FrequencyWarp, LogMel, SpecAugment


def test_logmel_shapes_lengths_and_padding_invariance() -> None:
    torch.manual_seed(0)
    fe = LogMel(16_000, n_mels=40)
    short, long = torch.randn(8_000) * 0.1, torch.randn(12_345) * 0.1
    batch = torch.nn.utils.rnn.pad_sequence([short, long], batch_first=True)
    feats, n = fe(batch, torch.tensor([8_000, 12_345]))
    assert feats.shape == (2, 12_345 // 160 + 1, 40)
    assert n.tolist() == [51, 78]  # 10 ms hop, centred frames: len // 160 + 1
    alone, _ = fe(short[None], torch.tensor([8_000]))
    # reference: the same utterance without padding; frames near the end see zeros either way
    torch.testing.assert_close(feats[0, :51], alone[0], rtol=0, atol=1e-4)
    assert feats[0, 51:].abs().max() == 0  # padding frames are exactly zero
    valid = feats[1, :78]
    torch.testing.assert_close(valid.mean(0), torch.zeros(40), rtol=0, atol=1e-4)  # per-utterance CMVN
    torch.testing.assert_close(valid.std(0, unbiased=False), torch.ones(40), rtol=0, atol=1e-2)


def test_specaugment_masks_per_utterance_and_keeps_the_rest() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 200, 80) + 5.0  # offset so no value is 0 by chance
    y = SpecAugment(freq_masks=2, freq_width=15, time_masks=2, time_width=20)(x)
    masked = y == 0
    assert masked.any()
    kept = ~masked
    assert torch.equal(y[kept], x[kept])
    patterns = {tuple(masked[b].flatten().tolist()) for b in range(4)}
    assert len(patterns) > 1  # masks differ between utterances
    assert torch.equal(SpecAugment(0, 15, 0, 20)(x), x)


def test_frequency_warp_stretches_each_utterance_linearly() -> None:
    torch.manual_seed(0)
    ramp = torch.arange(80.0).expand(6, 50, 80)  # feature value = bin index
    y = FrequencyWarp(0.1)(ramp)
    slopes = (y[:, :, 1:40] - y[:, :, :39]).mean(-1)  # below the clamped top edge
    # reference: linear interpolation of a ramp is exact, so every bin steps by the warp factor alpha
    torch.testing.assert_close(slopes, slopes[:, :1].expand_as(slopes), rtol=0, atol=1e-5)
    alpha = slopes[:, 0]
    assert ((alpha >= 0.9) & (alpha <= 1.1)).all() and alpha.std() > 0.01
    assert y[:, :, 0].abs().max() == 0 and y.max() <= 79
    assert torch.equal(FrequencyWarp(0.0)(ramp), ramp)
