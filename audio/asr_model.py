"""The speech-model contract the ASR task relies on: what a model takes and what it has, asked of the model
(class attributes and properties), never of the config's name.

Every family implements it: Conformer-CTC (`audio.conformer`: log-mel features in, a CTC head, optionally a
joint attention decoder), wav2vec 2.0 / HuBERT / WavLM (`audio.wav2vec2`: waveforms in, a CTC head) and
Whisper (`audio.whisper`: waveforms in, its own tokenizer and sequence-to-sequence decoder). `forward` is
`forward(inputs, lengths, tokens=None)` for all three: features or waveforms (as `takes_audio` says) with
their lengths; a CTC model returns (log-probabilities, frames) and, given `tokens`, its attention decoder's
logits third; a sequence-to-sequence model returns its decoder's logits of `tokens`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import nn

from core.compile.state_dict import unwrap
from core.errors import ConfigError


class ASRModel(nn.Module):
    """A speech model as the ASR task sees it: its inputs (features or raw audio) and its outputs (a CTC head,
    a joint attention decoder, a sequence-to-sequence decoder)."""

    #: the task feeds waveforms (the model has its own front end), not the task's log-mel features
    takes_audio: ClassVar[bool] = False
    #: the model transcribes with its own tokenizer and decoder (no CTC head; `generate`, `prompt`)
    seq2seq: ClassVar[bool] = False
    #: the settings a pretrained file's own config decides (what a run saves in pretrained_sizes.json)
    size_keys: ClassVar[tuple[str, ...]] = ()
    #: the sizes a pretrained file's own config gave the model (saved with a run, to rebuild it); {}: none
    file_sizes: Mapping[str, Any] = MappingProxyType({})

    @property
    def has_ctc_head(self) -> bool:
        """Whether the model outputs CTC log-probabilities per frame."""
        return not self.seq2seq

    @property
    def has_joint_decoder(self) -> bool:
        """Whether an attention decoder sits beside the CTC head (joint CTC/attention training and decoding);
        its module is `attention_decoder`."""
        return getattr(self, "attention_decoder", None) is not None

    def out_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """Output frames of inputs of `lengths` (feature frames, or samples for a model on raw audio)."""
        raise NotImplementedError


def asr_model(model: nn.Module) -> ASRModel:
    """The ASRModel behind a data-parallel or `torch.compile` wrapper."""
    inner = unwrap(model)
    return unwrap(getattr(inner, "module", inner))


def registered_class(builder: Callable[..., Any]) -> type[ASRModel]:
    """The model class a registered builder makes (a preset's class, or the class its builder's signature
    returns): what the task asks before building, e.g. whether to learn a tokenizer first."""
    target = getattr(builder, "__wrapped__", builder)
    return target if inspect.isclass(target) else inspect.signature(target).return_annotation


def check_ctc_head(net: ASRModel, symbols: int) -> None:
    """The ConfigError for a CTC head whose outputs (model.vocab_size) are not the tokenizer's `symbols`."""
    if getattr(net, "vocab_size", symbols) != symbols:
        raise ConfigError(
            f"model.vocab_size={net.vocab_size} but the character vocabulary has {symbols} "
            f"symbols; set model.vocab_size={symbols}",
            key="model.vocab_size",
            value=str(net.vocab_size),
            valid=(str(symbols),),
        )
