"""The ASR task's training losses, chosen by what the model has (`audio.asr_model.ASRModel`): CTC over a CTC
head; joint CTC/attention with an attention decoder beside it; a sequence-to-sequence model's teacher-forced
cross-entropy."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from audio.asr_model import asr_model
from audio.ctc import CharTokenizer

#: the attention decoder's <sos> and <eos>: the CTC blank's id, which is never a label
SOS = EOS = CharTokenizer.blank


def model_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's two inputs from a batch the task's front end prepared: features or waveforms, with
    lengths."""
    if "features" in batch:
        return batch["features"], batch["feature_lengths"]
    return batch["audio"], batch["audio_lengths"]


def ctc_loss(
    log_probs: torch.Tensor, lengths: torch.Tensor, batch: dict[str, torch.Tensor], blank: int
) -> torch.Tensor:
    """torch's mean CTC loss (per target label, averaged over the batch)."""
    return F.ctc_loss(
        log_probs.transpose(0, 1).float(),
        batch["targets"],
        lengths,
        batch["target_lengths"],
        blank=blank,
        zero_infinity=True,  # an utterance too fast for its frames must not poison the batch with inf
    )


def joint_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], blank: int, ctc_weight: float, label_smoothing: float
) -> tuple[Any, ...]:
    """ctc_weight * CTC + (1 - ctc_weight) * the decoder's label-smoothed cross-entropy, teacher-forced
    on <sos> + labels -> labels + <eos>; each utterance's cross-entropy is a mean over its tokens, as
    torch's CTC mean is over its characters, so both weigh every utterance the same."""
    targets, n = batch["targets"], batch["target_lengths"]
    first = torch.full_like(targets[:, :1], SOS)
    inputs = torch.cat([first, targets], 1)
    pos = torch.arange(inputs.shape[1], device=targets.device)[None, :]
    outputs = torch.cat([targets, first], 1)
    outputs = outputs.masked_fill(pos == n[:, None], EOS).masked_fill(pos > n[:, None], -100)
    # padded inputs after each <eos> are masked from the real positions by causality: no token mask
    log_probs, lengths, logits = model(batch["features"], batch["feature_lengths"], inputs)
    ce = F.cross_entropy(
        logits.float().transpose(1, 2), outputs, label_smoothing=label_smoothing, reduction="none"
    )
    ce = (ce.sum(1) / (n + 1)).mean()
    ctc = ctc_loss(log_probs, lengths, batch, blank)
    loss = ctc_weight * ctc + (1 - ctc_weight) * ce
    return loss, log_probs, lengths, {"ctc_loss": ctc.detach(), "attention_loss": ce.detach()}


def seq2seq_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, ...]:
    """A sequence-to-sequence model's teacher-forced cross-entropy: prompt + tokens -> tokens + <end>,
    each utterance's a mean over its tokens (as CTC's is over its labels), averaged over the batch."""
    net = asr_model(model)
    targets, n = batch["targets"], batch["target_lengths"]
    prompt = net.prompt(targets.shape[0], targets.device)
    inputs = torch.cat([prompt, targets], 1)
    p = prompt.shape[1]
    pos = torch.arange(targets.shape[1] + 1, device=targets.device)[None, :]
    outputs = torch.cat([targets, targets[:, :1]], 1)
    outputs = outputs.masked_fill(pos == n[:, None], net.tokenizer.eot).masked_fill(pos > n[:, None], -100)
    logits = model(batch["audio"], batch["audio_lengths"], inputs)[:, p - 1 :]
    ce = F.cross_entropy(logits.float().transpose(1, 2), outputs, reduction="none")
    return (ce.sum(1) / (n + 1)).mean(), None, None, {}


def asr_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], blank: int, ctc_weight: float, label_smoothing: float
) -> tuple[Any, ...]:
    """(loss, CTC log-probabilities or None, their frame counts or None, the loss's parts as metrics): the
    loss of what `model` has."""
    net = asr_model(model)
    if net.seq2seq:
        return seq2seq_loss(model, batch)
    if net.has_joint_decoder:
        return joint_loss(model, batch, blank, ctc_weight, label_smoothing)
    log_probs, lengths = model(*model_inputs(batch))
    return ctc_loss(log_probs, lengths, batch, blank), log_probs, lengths, {}
