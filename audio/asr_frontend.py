"""What the ASR task does to waveforms on the training device before the model sees them: reverberation and
noise while training, then, for a model on features, the log-mel front end, frequency warping and
SpecAugment while training. A model that takes audio (`ASRModel.takes_audio`) gets the waveforms."""

from __future__ import annotations

import torch
from torch import nn

from audio.asr_model import asr_model
from audio.augment import AddNoise, Reverb
from audio.features import FrequencyWarp, LogMel, SpecAugment
from core.errors import ConfigError


class FrontEnd:
    """The task's waveform -> model-input step, with its augmentations (task.noise_*, task.reverb_*,
    task.freq_warp, task.spec_augment and the masks' sizes)."""

    def __init__(
        self,
        sample_rate: int,
        *,
        spec_augment: bool,
        masks: tuple[int, int, int, int],
        freq_warp: float,
        noise: tuple[float, tuple[float, float]],
        reverb: tuple[float, tuple[float, float]],
    ) -> None:
        """`masks`: (freq_masks, freq_width, time_masks, time_width); `noise`: (noise_prob, noise_snr);
        `reverb`: (reverb_prob, reverb_rt60)."""
        for key, (lo, hi) in (("noise_snr", noise[1]), ("reverb_rt60", reverb[1])):
            if lo > hi:
                raise ConfigError(
                    f"task.{key}=[{lo},{hi}] is not [lowest,highest]; swap the two values",
                    key=f"task.{key}",
                    value=f"[{lo},{hi}]",
                    valid=("[lowest,highest]",),
                )
        self.sample_rate = sample_rate
        self.augment = SpecAugment(*masks) if spec_augment else None
        self.warp = FrequencyWarp(freq_warp)
        self.noise = AddNoise(*noise)
        self.reverb = Reverb(*reverb, sample_rate)
        self.features: LogMel | None = None

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`batch`'s waveforms as `model` takes them (training augmentations when it is in training mode)."""
        if "features" in batch:
            return batch
        audio, audio_lengths = batch["audio"], batch["audio_lengths"]
        if model.training:
            # noise after reverberation, so the noise itself is not reverberated (as a microphone's is not)
            audio = self.noise(self.reverb(audio, audio_lengths), audio_lengths)
        net = asr_model(model)
        if net.takes_audio:  # its own front end; masking is the model's, in training mode
            return {**batch, "audio": audio}
        if self.features is None:
            self.features = LogMel(self.sample_rate, net.n_mels)
        self.features = self.features.to(audio.device)
        feats, lengths = self.features(audio, audio_lengths)
        if model.training:
            feats = self.warp(feats)
            if self.augment is not None:
                feats = self.augment(feats)
        out = {k: v for k, v in batch.items() if k not in ("audio", "audio_lengths")}
        return out | {"features": feats, "feature_lengths": lengths}
